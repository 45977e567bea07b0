"""DSpark draft: the DFlash backbone in which every block slot predicts, plus a sequential
Markov head (and an optional confidence head); config, the served module (vLLM
`Qwen3DSparkModel` layout), its training step and its in-tree proposer.

Sources: DSpark (DeepSeek, 2026: a parallel draft backbone with a cheap sequential
correction so that neighbouring draft tokens agree); served layout
vllm/model_executor/models/qwen3_dspark.py and vllm/v1/worker/gpu/spec_decode/dspark/
speculator.py (vLLM 0.32); the loss from DeepSeek's DeepSpec training code.

What vLLM computes, and so what this module computes:
    backbone  DFlash's (trainer/drafts/dflash.py): context keys/values from the target's
              states before the anchor, the block [anchor, MASK x (K-1)] at positions p..p+K-1,
              bidirectional inside the block ("sample from anchor": N = K queries, not 1 + N)
    base      U_k = lm_head(norm(h_k)), slot k (0-based) predicting the token at p+k+1
    Markov    logits_k = U_k + W2 W1[x_{k-1}], x_{-1} = the anchor, x_k the token drafted at
              slot k: applied left to right after the one backbone pass. W1 = Embedding(V, r)
              over target ids, W2 = Linear(r -> Vd, no bias). The corrected softmaxes are the q
              of lossless rejection sampling.
    confidence  c_k = sigmoid(w . [norm(h_k) ; W1[x_{k-1}]] + b) (in fp32), the predicted
              probability that slot k is accepted; vLLM uses it for adaptive verification.
N = num_speculative_tokens <= K (the block size; B is the batch).

Module layout (a one-to-one key map on export: `backbone.` is dropped, the rest are vLLM's
names): backbone.{fc, hidden_norm, layers.*, norm, [lm_head, d2t, t2d]},
markov_head.markov_w1 [V, r], markov_head.markov_w2 [Vd, r], confidence_head.proj [1, H(+r)].
The token embedding and, by default, the LM head are the target's, frozen, not saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from trainer import losses
from trainer.drafts import dflash
from trainer.drafts.shape import supervised
from trainer.errors import ConfigError
from trainer.metrics import StepMetrics
from trainer.settings import setting
from trainer.speculative import Proposal

MARKOV_HEAD_TYPES = ("vanilla",)  # the only head vLLM 0.32 builds (qwen3_dspark.py DSparkMarkovHead)


def default_layer_ids(num_layers: int) -> list[int]:
    """DFlash's: 5 target layers spread over output-of-layer ids 1..L-3 (entering-layer ids
    here), so that one capture serves DFlash and DSpark drafts alike."""
    return dflash.default_layer_ids(num_layers)


@dataclass
class DSparkConfig(dflash.DFlashConfig):
    """The DFlash fields (shape, layer ids, mask token, anchors) with DSpark's defaults, plus
    the Markov and confidence heads and the DeepSpec loss mix."""

    block_size: int = setting(7, "K: [anchor, MASK x (K-1)], every slot predicts (DSpark's Qwen3-8B: 7)", ge=2)
    gamma: float = setting(4.0, "slot k (0-based) weighs exp(-k/gamma) (DeepSpec)", gt=0)
    labels: str = setting("data", "what ce trains toward: data, the token in the data (DeepSpec); target, the "
                                  "target's greedy token", choices=("target", "data"))
    markov_rank: int = setting(256, "r, the Markov head's rank (a DSpark draft without one is a DFlash draft: use "
                                    "algorithm=dflash)", ge=1)
    markov_head_type: str = setting("vanilla", "the Markov head (vLLM builds only the vanilla head)",
                                    choices=MARKOV_HEAD_TYPES)
    enable_confidence_head: bool = setting(True, "a head predicting each slot's acceptance")
    confidence_head_with_markov: bool = setting(True, "the confidence head reads [norm(h_k); W1[x_{k-1}]]")
    ce_weight: float = setting(0.1, "DeepSpec's loss, ce_weight x CE + tv_weight x |p_draft - p_target|_1 + "
                                    "confidence_weight x BCE(c_k, 1 - |.|_1 / 2): CE's weight", ge=0)
    tv_weight: float = setting(0.9, "DeepSpec's L1 term's weight (its TV term is the full L1 norm, 2 TV)", ge=0)
    confidence_weight: float = setting(1.0, "DeepSpec's confidence BCE's weight", ge=0)
    loss: str = setting("deepspec", "the objective: deepspec, the mix above; or trainer/losses.py's objectives (the "
                                    "confidence head's BCE is added to any)")

    own_objectives: ClassVar[tuple[str, ...]] = ("deepspec",)

    def validate(self) -> None:
        super().validate()
        if self.ce_weight + self.tv_weight <= 0:
            raise ConfigError("draft.ce_weight + tv_weight must be > 0 (DeepSpec's loss needs a term that trains the "
                              "draft's distribution)")

    @property
    def num_positions(self) -> int:
        return self.block_size

    @property
    def max_draft_tokens(self) -> int:
        """Every slot of the block predicts (sample from anchor): N <= K."""
        return self.block_size


class MarkovHead(nn.Module):
    """The low-rank first-order transition bias W2 W1[prev]: prev target ids [...] -> [..., Vd]."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as a DFlash-like backbone: no bias until learned

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """c = sigmoid(proj([h ; e])), in fp32 as vLLM runs it (its params are fp32)."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hn: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hn [..., H] normed backbone states; markov_embed [..., r] -> logit of acceptance [...]."""
        x = torch.cat([hn, markov_embed], -1) if self.with_markov else hn
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float())[..., 0]


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DSparkConfig, embed_tokens: nn.Embedding | None = None,
                 lm_head: nn.Module | None = None):
        super().__init__()
        self.config = cfg
        self.backbone = dflash.DFlashDraft(cfg, embed_tokens, lm_head)
        Vd = cfg.draft_vocab_size or cfg.vocab_size
        self.markov_head = MarkovHead(cfg.vocab_size, Vd, cfg.markov_rank)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width, cfg.confidence_head_with_markov)

    @property
    def gradient_checkpointing(self) -> bool:
        return self.backbone.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:  # the backbone's layers are recomputed
        self.backbone.gradient_checkpointing = on

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.backbone.set_vocab(d2t, t2d)

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary."""
        return self.backbone.draft_to_target()

    def slot_logits(self, hn: torch.Tensor, prev: torch.Tensor, markov: bool = True) -> torch.Tensor:
        """hn [..., H] normed slot states; prev [...] target id before each slot -> [..., Vd]."""
        base = self.backbone.head(hn)
        return base + self.markov_head(prev).to(base.dtype) if markov else base

    def confidence(self, hn: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """P(slot accepted) [...] (vLLM compute_confidence); needs the confidence head."""
        return torch.sigmoid(self.confidence_head(hn, self.markov_head.markov_w1(prev)))


Draft = DSparkDraft
Config = DSparkConfig

fill_from_data = dflash.fill_from_data  # the mask token: a token the data never uses


def training_step(draft: DSparkDraft, batch: dict, labels: dict) -> StepMetrics:
    """One DSpark training step over DFlash's packed anchor blocks, Markov head teacher-forced.

    batch: input_ids, loss_mask, attention_mask [B, T], aux_hidden_states [B, T, L*Ht].
    labels (`target_labels`): anchors/valid [B, n]; target_ids [B, T] (the target's greedy
    token after each position); target_p [U, Vd] (the target's next-token distribution,
    restricted to the draft vocabulary) at the positions `target_row` [B, n, K] points to,
    with target_outside [U] = its mass outside the draft vocabulary.

    Slot k (0-based) of the block at anchor a predicts the token at a+k+1 from the base
    logits plus the Markov bias of x_{k-1} = the data token at a+k (teacher forcing; the
    anchor for k = 0). Per slot: ce_weight CE(want) + tv_weight |q - p|_1 + confidence_weight
    BCE(c_k, 1 - |q - p|_1 / 2) with the target detached, weighted exp(-k/gamma), supervision
    stopping at the first slot outside the trained positions (`loss_on`).
    """
    cfg = draft.config
    ids, anchors = batch["input_ids"], labels["anchors"]
    K = cfg.block_size
    h = dflash.block_states(draft.backbone, batch, anchors, labels["valid"])  # [B, n, K, H]
    at, live = dflash.slot_supervision(batch, anchors, labels["valid"], first=1, slots=K,  # token at a+k+1
                                       loss_on=cfg.loss_on)
    greedy = labels["target_ids"].gather(1, (at - 1).flatten(1)).view_as(at)
    prev = ids.gather(1, (at - 1).flatten(1)).view_as(at)  # x_{k-1}: the data token at a+k
    want = ids.gather(1, at.flatten(1)).view_as(at) if cfg.labels == "data" else greedy

    rows = live.reshape(-1)
    hn = draft.backbone.norm(h.reshape(-1, h.shape[-1])[rows])  # [R, H] supervised slots only
    prev_r, target_r = prev.reshape(-1)[rows], dflash.to_draft_ids(draft.backbone, want.reshape(-1)[rows])
    p_row = labels["target_row"].reshape(-1)[rows]
    row_loss, argmax, alpha = losses.in_row_chunks(
        lambda hn, prev, target, p_row: slot_losses(draft, hn, prev, target, labels["target_p"],
                                                    labels["target_outside"], p_row),
        (hn, prev_r, target_r, p_row), cfg.loss_chunk_rows)
    loss = dflash.weighted_mean(row_loss, live, cfg.gamma)
    return dflash.block_metrics(loss, draft.draft_to_target()[argmax], greedy, live, row_loss, alpha)


def slot_losses(draft: DSparkDraft, hn, prev, target, target_p, target_outside, p_row):
    """Per supervised slot (rows of hn [R, H]): the DeepSpec loss [R] and the argmax draft id [R]."""
    cfg = draft.config
    logits = draft.slot_logits(hn, prev).float()  # [R, Vd]
    logq = logits.log_softmax(-1)
    p = target_p[p_row].float()  # [R, Vd]
    l1 = (logq.exp() - p).abs().sum(-1) + target_outside[p_row].float()  # mass q cannot cover counts fully
    if cfg.loss == "deepspec":
        ce = F.nll_loss(logq, target.clamp(min=0), reduction="none") * (target >= 0)
        loss = cfg.ce_weight * ce + cfg.tv_weight * l1
    else:
        loss = losses.objective_rows(losses.parse_objective(cfg.loss), logits, p, target, cfg.lk_eta, logq)
    if draft.confidence_head is not None and cfg.confidence_weight > 0:
        c = draft.confidence_head(hn, draft.markov_head.markov_w1(prev))  # logit
        accept = (1 - 0.5 * l1).detach().clamp(0, 1)  # P(a draw from q is accepted) = 1 - TV(p, q)
        loss = loss + cfg.confidence_weight * F.binary_cross_entropy_with_logits(c, accept, reduction="none")
    return loss, logits.argmax(-1), (1 - 0.5 * l1).detach()  # α = Σ_Vd min(p, q) = 1 - TV(p, q)


@torch.no_grad()
def target_labels(target, batch: dict, draft: DSparkDraft, chunk: int = 512) -> dict:
    """DFlash's random anchors (the global RNG: seeded, restored on resume) and the target's
    next-token distribution at the positions the loss reads (anchor + k for every slot of a
    valid block), computed once per distinct position from the captured pre-norm last state,
    `chunk` positions at a time: never a [B, T, V] tensor, nor one per slot.

    Returns anchors, valid [B, n]; target_row [B, n, K] (row of target_p for the state at
    anchor + k, -1 where no slot needs it); target_p [U, Vd] (restricted to the draft
    vocabulary, not renormalized), target_outside [U] (its mass outside), U <= min(B*T,
    B*n*K); target_ids [B, T] (the target's greedy token after each position: the capture's
    target_argmax, -1 at padding). Memory: U * Vd floats, plus chunk * V while computing."""
    anchors, valid = dflash.sample_anchors(supervised(batch, draft.config.loss_on), batch["attention_mask"],
                                           draft.config.num_anchors)
    return {"anchors": anchors, "valid": valid, "target_ids": batch["target_argmax"].long(),
            **dflash.slot_distributions(target, batch, draft, anchors, valid, draft.config.block_size, chunk)}


class DSparkProposer:
    """DSpark drafting for the in-tree decoder, as vLLM's DSpark speculator runs it: the
    context is kept as for DFlash (dflash.DFlashProposer); each round one backbone forward
    over [pending token, MASK x (N-1)] gives base logits for N slots, then the Markov bias is
    applied left to right from the token drafted before each slot (the pending token first).

    markov=False drafts from the base logits alone (the ablation). draft_topk (vLLM's
    `dspark_draft_topk`): the Markov correction only for the top-k base candidates of each
    slot, every other token at -inf.
    """

    OPTIONS = ("markov", "draft_topk")  # what `draftsmith eval` may pass (export/load.py load_proposer)
    ABLATIONS = {"without_markov": {"markov": False}}  # the same backbone, base logits alone
    parallel = True  # one backbone forward a round (the Markov head is a cheap row gather per slot)

    def __init__(self, draft: DSparkDraft, draft_sampling: str = "greedy", seed: int = 0, markov: bool = True,
                 draft_topk: int | None = None):
        Vd = draft.config.draft_vocab_size or draft.config.vocab_size
        if draft_topk is not None and not 1 <= draft_topk <= Vd:
            raise ConfigError(f"draft_topk {draft_topk} must be between 1 and the draft vocabulary size ({Vd})")
        self.draft = draft.eval()
        self.context = dflash.DFlashProposer(draft.backbone, draft_sampling, seed)
        self.aux_layer_ids = self.context.aux_layer_ids
        self.max_draft_tokens = draft.config.max_draft_tokens
        # DSpark's draft ids: the backbone's
        self.target_ids, self.sample = self.context.target_ids, self.context.sample
        self.markov, self.draft_topk = markov, draft_topk

    def begin(self, sequences, aux, mask):
        self.context.begin(sequences, aux, mask)

    def commit(self, sequences, aux, keep):
        self.context.commit(sequences, aux, keep)

    @torch.no_grad()
    def propose(self, sequences, n: int, sampling):
        draft = self.draft
        hn = draft.backbone.norm(self.context.block_hidden(sequences, n))  # [B, n, H]: slot k predicts p+k+1
        base = draft.backbone.head(hn)  # [B, n, Vd]
        if self.draft_topk is not None:
            values, index = base.topk(self.draft_topk, dim=-1)  # [B, n, k], chosen once for all slots
        prev = torch.tensor([s[-1] for s in sequences], device=base.device)  # [B] the anchor
        tokens, qs = [], []
        for k in range(n):
            if not self.markov:
                logits = base[:, k]
            elif self.draft_topk is None:
                logits = base[:, k] + draft.markov_head(prev).to(base.dtype)
            else:  # bias only where it is needed: W2's rows of the candidates
                e = draft.markov_head.markov_w1(prev)  # [B, r]
                w2 = draft.markov_head.markov_w2.weight[index[:, k]]  # [B, k, r]
                corrected = values[:, k] + (w2 @ e[..., None].to(w2.dtype))[..., 0].to(values.dtype)
                logits = base.new_full(base[:, k].shape, float("-inf")).scatter(1, index[:, k], corrected)
            x, q = self.sample(logits, sampling)
            tokens.append(x)
            qs.append(q)
            prev = x
        return Proposal(torch.stack(tokens, 1), None if qs[0] is None else torch.stack(qs, 1))


Proposer = DSparkProposer

__all__ = ["Config", "Draft", "Proposer", "default_layer_ids", "fill_from_data", "training_step",
           "target_labels"]

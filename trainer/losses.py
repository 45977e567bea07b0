"""Pure loss functions: the objectives a draft trains on (`draft.loss`), per supervised row.

Notation: p = the target's next-token distribution over the draft vocabulary ([R, Vd] rows;
EAGLE-3's is renormalized over the draft vocabulary, DFlash's and DSpark's keep the target's
mass outside it, so their rows may sum to less than 1), q = softmax(draft logits) [R, Vd].
Under rejection sampling (Leviathan et al., 2023, §2.3; Chen et al., 2023) a token drawn from q
is accepted with probability α = Σ_v min(p_v, q_v) = 1 - TV(p, q): one position's acceptance.

The objectives (each per row [R]; a spec mixes them with weights, `parse_objective`):
  fkl        forward KL as the cross-entropy -Σ p log q (KL(p‖q) + H(p): the same gradients; the
             EAGLE-3 reference objective, Li et al., 2025)
  ce         cross-entropy against one token (the target's greedy token or the data's): -log q_y
             (DFlash's objective, Chen et al., 2026)
  rkl        reverse KL, Σ q (log q - log p) (mode seeking; Gu et al., 2024, MiniLLM)
  jsd        Jensen-Shannon, ½ KL(p‖m) + ½ KL(q‖m), m = (p + q) / 2 (Lin, 1991)
  tv         total variation, 1 - Σ min(p, q) = 1 - α: acceptance itself (DistillSpec, Zhou et al., 2024)
  lk         negative log-acceptance, -log α (Samarin et al., 2026, "LK Losses: Direct Acceptance
             Rate Optimization for Speculative Decoding", arXiv 2602.23881): TV's gradient scaled
             by 1/α, usable from a cold start; for a one-hot p it is the cross-entropy
  lk_hybrid  λ KL(p‖q) + (1 - λ) TV, λ = exp(-η sg[α]) (the same paper's hybrid; η = 3 its best):
             KL's strong gradient while α is low, acceptance itself as α grows
speculators 0.9 (speculators/losses/eager.py) defines the same set; these are written from the
definitions above, and tests/test_losses.py holds each to a direct computation.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

OBJECTIVES = ("fkl", "ce", "rkl", "jsd", "tv", "lk", "lk_hybrid")
_TINY = torch.finfo(torch.float32).tiny  # log p of a probability that underflowed to 0
_NLA_EPS = 1e-5  # -log α is capped at -log(1e-5) ≈ 11.5 where draft and target do not overlap


def parse_objective(text: str) -> dict[str, float]:
    """`draft.loss` -> {objective: weight}: one name ("tv"), or weighted terms ("ce:0.1,tv:0.9").
    Raises ValueError naming what is wrong."""
    spec: dict[str, float] = {}
    for part in str(text).split(","):
        name, _, weight = part.strip().partition(":")
        name = name.strip()
        if name not in OBJECTIVES:
            raise ValueError(f"'{name}' is not an objective (one of {', '.join(OBJECTIVES)})")
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"the weight of '{name}' is '{weight.strip()}', not a number") from None
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"the weight of '{name}' must be a finite number > 0 (got {w})")
        if name in spec:
            raise ValueError(f"'{name}' is named twice")
        spec[name] = w
    return spec


def acceptance(logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """α = Σ_v min(p_v, q_v) per row: logq [R, Vd] (log-softmax of the draft's logits), p [R, Vd] -> [R]."""
    return torch.minimum(logq.exp(), p).sum(-1)


def _kl(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) = Σ p (log p - log q), 0 log 0 = 0. -> [R]"""
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def objective_rows(spec: dict[str, float], logits: torch.Tensor, p: torch.Tensor | None = None,
                   label: torch.Tensor | None = None, eta: float = 3.0, logq: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Σ_name weight x objective(name) per row [R]. logits [R, Vd] (the draft's, any dtype: computed
    in float32); p [R, Vd] the target's probabilities (every objective but ce); label [R] the
    draft-vocabulary id ce trains toward (-1: not in the draft vocabulary, no ce loss there); logq:
    log_softmax(logits) where the caller has it already (the step's acceptance reads it too)."""
    if logq is None:
        logq = torch.log_softmax(logits.float(), dim=-1)  # [R, Vd]
    total = logq.new_zeros(logq.shape[0])
    if p is not None:
        p = p.float()
        if spec.keys() & {"rkl", "jsd", "lk_hybrid"}:
            logp = p.clamp(min=_TINY).log()
    for name, weight in spec.items():
        if name == "fkl":
            row = -(p * logq).sum(-1)
        elif name == "ce":
            row = -logq.gather(-1, label.clamp(min=0)[:, None])[:, 0] * (label >= 0)
        elif name == "rkl":
            q = logq.exp()
            row = (q * (logq - logp)).sum(-1)
        elif name == "jsd":
            q = logq.exp()
            logm = torch.logaddexp(logp, logq) - math.log(2.0)
            row = 0.5 * (_kl(p, logp, logm) + (q * (logq - logm)).sum(-1))
        elif name == "tv":
            row = 1.0 - acceptance(logq, p)
        elif name == "lk":
            row = -acceptance(logq, p).clamp(min=_NLA_EPS).log()
        elif name == "lk_hybrid":
            alpha = acceptance(logq, p)
            lam = torch.exp(-eta * alpha.detach())
            row = lam * _kl(p, logp, logq) + (1.0 - lam) * (1.0 - alpha)
        else:
            raise ValueError(f"unknown objective '{name}'")
        total = total + weight * row
    return total


def per_sample_mean(per_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """per_pos [N] (rows at mask's True positions, in row-major order) averaged over each sample's
    rows, then over samples: a batch of B equals B accumulated batches of one. mask [B, T] bool."""
    sample = mask.nonzero()[:, 0]  # [N] the sample of each row
    sums = per_pos.new_zeros(mask.shape[0]).index_add_(0, sample, per_pos)  # [B]
    return (sums / mask.sum(-1).to(sums.dtype).clamp(min=1.0)).mean()


def in_row_chunks(fn, rows: tuple[torch.Tensor, ...], chunk: int, recompute: bool = False
                  ) -> tuple[torch.Tensor, ...]:
    """fn over `rows` (tensors [R, ...] sliced together) `chunk` rows at a time, its outputs
    ([r, ...] each) concatenated. With more than `chunk` rows, each chunk's intermediates (the
    [r, Vd] logits) are recomputed in backward (torch.utils.checkpoint) instead of stored, so
    at most one chunk's are alive. chunk 0: one pass. recompute: recompute in backward even in one
    chunk (activation checkpointing)."""
    R = rows[0].shape[0]
    step = chunk or R or 1
    recompute = (recompute or R > step) and torch.is_grad_enabled()
    parts = []
    for i in range(0, max(R, 1), step):
        args = [r[i:i + step] for r in rows]
        parts.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    return tuple(torch.cat(x) for x in zip(*parts))


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v), averaged over each sample's masked positions, then over samples.

    EAGLE-3 trains on the target's distribution, not its sampled token. Per-sample
    averaging makes a batch of B equal to B accumulated batches of one.
    logits, target_p: [N, Vd], given only at the masked positions, N = mask.sum(), rows in
    mask's row-major order (`x[mask]`): the head and softmax never run where the loss does
    not look. mask: [B, T] bool.
    """
    return per_sample_mean(objective_rows({"fkl": 1.0}, logits, target_p), mask)

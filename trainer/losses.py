"""Pure loss functions."""

from __future__ import annotations

import torch


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v), averaged over each sample's masked positions, then over samples.

    EAGLE-3 trains on the target's distribution, not its sampled token. Per-sample
    averaging makes a batch of B equal to B accumulated batches of one.
    logits, target_p: [B, T, Vd]; mask: [B, T] bool.
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    per_pos = -(target_p * logq).sum(-1)  # [B, T]
    m = mask.to(per_pos.dtype)
    per_sample = (per_pos * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
    return per_sample.mean()

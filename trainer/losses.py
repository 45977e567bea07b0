"""Pure loss functions."""

from __future__ import annotations

import torch


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -Σ_v p(v) log q(v) (EAGLE-3 trains on the target's
    distribution, not its sampled token). logits, target_p: [B, T, Vd]; mask: [B, T] bool."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    per_pos = -(target_p * logq).sum(-1)  # [B, T]
    m = mask.to(per_pos.dtype)
    return (per_pos * m).sum() / m.sum().clamp(min=1.0)

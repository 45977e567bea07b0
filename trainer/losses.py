"""Pure loss functions."""

from __future__ import annotations

import torch


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v), averaged over each sample's masked positions, then over samples.

    EAGLE-3 trains on the target's distribution, not its sampled token. Per-sample
    averaging makes a batch of B equal to B accumulated batches of one.
    logits, target_p: [N, Vd], given only at the masked positions, N = mask.sum(), rows in
    mask's row-major order (`x[mask]`): the head and softmax never run where the loss does
    not look. mask: [B, T] bool.
    """
    per_pos = -(target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [N]
    sample = mask.nonzero()[:, 0]  # [N] the sample of each row
    sums = per_pos.new_zeros(mask.shape[0]).index_add_(0, sample, per_pos)  # [B]
    return (sums / mask.sum(-1).to(sums.dtype).clamp(min=1.0)).mean()

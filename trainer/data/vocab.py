"""Draft vocabulary: the top-Vd target tokens by frequency over loss-masked tokens.

EAGLE-3 (reference `eagle/traineagle3/cnets.py`, vLLM `llama_eagle3.py`) maps draft
ids to target ids with offsets: target_id = draft_id + d2t[draft_id]; `t2d` marks
the target ids the draft can emit. The chosen ids are kept in ascending target-id
order, as the reference does, so d2t is non-decreasing.
"""

from __future__ import annotations

import torch


def token_counts(input_ids, loss_masks, vocab_size: int) -> torch.Tensor:
    """Counts [V] of tokens under the loss mask, over an iterable of samples."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in zip(input_ids, loss_masks):
        ids = torch.as_tensor(ids, dtype=torch.int64)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) for the Vd most frequent tokens.

    Ties (and tokens never seen, when fewer than Vd are) go to the lower token id,
    so the result is deterministic.
    """
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{V} (the target vocab)")
    # Stable sort on -count keeps ascending ids among equal counts.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values  # [Vd] target ids, ascending
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)  # target_id = draft_id + d2t[draft_id]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of loss-masked tokens the draft vocabulary can emit."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0

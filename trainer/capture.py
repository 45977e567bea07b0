"""Hidden-state capture from the frozen target: one code path for offline shards
(recipes/capture.py) and online training (states for a batch, kept in memory)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.data.shards import store_states


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group positions into batches whose padded size B * T_max stays within `max_tokens`.

    Longest first, ties by position: deterministic, so a resumed capture runs the
    same batches (same shapes, same numerics) as an uninterrupted one. A sample
    longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        w = max(width, lengths[i])
        if current and w * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, w = [], lengths[i]
        current.append(i)
        width = w
    if current:
        batches.append(current)
    return batches


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] ids, [B, T] attention mask) with right padding (causal states of real tokens are unaffected)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def capture_batch(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layer_ids: Sequence[int],
                  dtype: torch.dtype | None = None, chunk: int = 1024) -> dict[str, torch.Tensor]:
    """Aux and last pre-norm hidden states of a padded batch, on the target's device, and
    the target's greedy next token at every position (from the full-precision state, `chunk`
    positions of [V] logits at a time): what training's accuracy and the block drafts'
    greedy labels need, computed once here instead of every epoch.

    input_ids, attention_mask: [B, T]. Returns aux_hidden_states [B, T, L*H] and
    last_hidden_state [B, T, H], cast to `dtype` when given; target_argmax [B, T] int32.
    """
    out = target.forward(input_ids.to(target.device), attention_mask.to(target.device),
                         aux_layer_ids=aux_layer_ids, return_logits=False)
    aux, last = out.aux_hidden_states, out.last_hidden_state
    argmax = torch.cat([target.logits_from_last_hidden(h).argmax(-1) for h in last.split(chunk, dim=1)], 1)
    if dtype is not None:
        aux, last = aux.to(dtype), last.to(dtype)
    return {"aux_hidden_states": aux, "last_hidden_state": last, "target_argmax": argmax.to(torch.int32)}


def sample_states(target, seqs: Sequence[Sequence[int]], pad_id: int, aux_layer_ids: Sequence[int], store_dtype: str,
                  samples: list) -> list[dict[str, torch.Tensor]]:
    """One padded forward over `seqs` -> per sequence, cut to its own length and on the CPU, the
    states online training reads: `target_argmax` and the stored aux/last states (`store_states`
    in `store_dtype`; `samples`: the prepared sample indices, named in its non-finite error).
    The one transformers capture loop: offline capture (recipes/capture.py, into shards) and the
    online hf engines (trainer/online/sources.py HFSource, producer.py) all make states here."""
    input_ids, attention_mask = right_pad(seqs, pad_id)  # [B, T]
    states = capture_batch(target, input_ids, attention_mask, aux_layer_ids)
    stored = store_states(states["aux_hidden_states"], states["last_hidden_state"], store_dtype, samples=samples,
                          lengths=[len(s) for s in seqs])
    stored = {k: v.cpu() for k, v in stored.items()}
    argmax = states["target_argmax"].cpu()
    return [{"target_argmax": argmax[r, :len(s)], **{name: v[r, :len(s)] for name, v in stored.items()}}
            for r, s in enumerate(seqs)]

"""Datasets and collation for draft training: captured samples (offline) or prepared
token ids whose states the target computes in the loop (online)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from trainer.data.shards import SCALES, CaptureReader, dequantize


class CapturedSamples(Dataset):
    """A capture's samples. With `max_length` a sample longer than that many tokens is skipped,
    never cut (a cut one would train the draft on a conversation that stops mid-answer):
    `skipped` counts them and the recipe says so in one line; null: every sample whole."""

    def __init__(self, path, max_length: int | None, layer_ids: list[int] | None = None):
        self.reader, self.max_length = CaptureReader(path, layer_ids), max_length
        self.kept, self.longest = fitting(self.reader.lengths(), max_length)
        self.skipped = len(self.reader) - len(self.kept)

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.reader[self.kept[i]]


class PreparedSamples(Dataset):
    """Prepared samples (token ids and loss mask: their states come from an online source), those
    longer than `max_length` skipped and counted as CapturedSamples does."""

    def __init__(self, ds, max_length: int | None):
        self.ds, self.max_length = ds, max_length
        self.kept, self.longest = fitting(list(ds["length"]), max_length)
        self.skipped = len(ds) - len(self.kept)

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ds[self.kept[i]]
        return {"input_ids": torch.tensor(row["input_ids"]), "loss_mask": torch.tensor(row["loss_mask"])}


def fitting(lengths: list[int], max_length: int | None) -> tuple[list[int], int]:
    """(the positions of the samples of at most `max_length` tokens, in order (all of them for
    None); the longest of those)."""
    kept = [i for i, n in enumerate(lengths) if max_length is None or n <= max_length]
    return kept, max((lengths[i] for i in kept), default=0)


STATES = ("aux_hidden_states", "last_hidden_state", "aux_scales", "last_scales")  # per token, stored dtype


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids/loss_mask/attention_mask [B, T], target_argmax
    [B, T] (captured samples; -1 at padding), states [B, T, D] in their stored dtype (bf16 captures stay bf16 until
    the device: half the host memory and transfer; every consumer casts where it computes; float8
    captures stay float8 with their scales until `dequantize_states` on the device)."""
    T = max(s["input_ids"].shape[0] for s in samples)
    B = len(samples)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.long),
           "attention_mask": torch.zeros(B, T, dtype=torch.long)}
    for name in STATES:
        if name in samples[0]:
            out[name] = torch.zeros(B, T, samples[0][name].shape[-1], dtype=samples[0][name].dtype)
    if "target_argmax" in samples[0]:
        out["target_argmax"] = torch.full((B, T), -1, dtype=torch.long)  # the target's greedy token; -1: padding
    for r, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        if "target_argmax" in s:
            out["target_argmax"][r, :n] = s["target_argmax"].long()
        out["input_ids"][r, :n] = s["input_ids"].long()
        out["loss_mask"][r, :n] = s["loss_mask"].long()
        out["attention_mask"][r, :n] = 1
        for name in STATES:
            if name in s:
                out[name][r, :n] = s[name]
    return out


def dequantize_states(batch: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A batch of a float8 capture (states with their per-row scales, trainer/data/shards.py) with
    its states dequantized where it now is (the training device), scales dropped; any other
    batch as it is."""
    for name, scale in SCALES.items():
        if scale in batch:
            batch[name] = dequantize(batch[name], batch.pop(scale), dtype)
    return batch

"""A sample's tensors as they travel between a producer and a trainer: numpy arrays (every
process of a Ray cluster can hold numpy; torch's bfloat16 and float8 ride as int16 and uint8
views of the same bytes) with their torch dtype named beside them. Imported by the vLLM
producer runner too (trainer/vllm/runners/vllm_produce.py): torch, numpy and the standard
library only."""

from __future__ import annotations

import torch

# dtypes numpy has no name for travel as a view of the same bytes
_VIEWS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                     torch.float8_e4m3fn, torch.int64, torch.int32, torch.uint8)}


def encode(sample: dict[str, torch.Tensor]) -> dict:
    """{name: tensor} -> {name: (numpy array, torch dtype name)}."""
    out = {}
    for name, t in sample.items():
        t = t.detach().cpu().contiguous()
        view = _VIEWS.get(t.dtype)
        out[name] = ((t.view(view) if view is not None else t).numpy(), str(t.dtype).removeprefix("torch."))
    return out


def decode(item: dict) -> dict[str, torch.Tensor]:
    """The inverse of `encode` (the arrays copied: a Ray object's arrays are read-only)."""
    out = {}
    for name, (array, dtype) in item.items():
        t = torch.from_numpy(array.copy())
        want = _DTYPES[dtype]
        out[name] = t.view(want) if want in _VIEWS else t
    return out


def tokens(sample: dict) -> int:
    """The tokens a sample holds (its input_ids, encoded or not)."""
    ids = sample["input_ids"]
    return int(ids[0].shape[0] if isinstance(ids, tuple) else ids.shape[0])

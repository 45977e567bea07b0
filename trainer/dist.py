"""Process state for `python` and `accelerate launch` runs alike.

`PartialState()` only takes the CPU distributed path (gloo) when told `cpu=True`;
accelerate's launcher exports ACCELERATE_USE_CPU but PartialState does not read it.
And `accelerate launch --cpu --num_processes 2` silently starts one process. So
the world size is checked against what the launcher exported (WORLD_SIZE).
"""

from __future__ import annotations

import os

import torch
from accelerate import PartialState

from trainer.errors import DraftsmithError


def flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def check_world_size(joined: int) -> None:
    """The processes that joined must be the ones the launcher started (WORLD_SIZE)."""
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if joined != expected:
        raise DraftsmithError(
            f"launcher asked for {expected} processes but {joined} joined; on CPU use "
            "`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N` "
            "(`--cpu --num_processes N` starts one process)"
        )


def process_state():
    on_cpu = flag("ACCELERATE_USE_CPU") or not (torch.cuda.is_available() or torch.xpu.is_available())
    state = PartialState(cpu=on_cpu)
    check_world_size(state.num_processes)
    if state.device.type == "cpu" and state.num_processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // state.num_processes))
    return state

"""Fault injection for the resume and nothing-lost tests: exit abruptly (as a kill would, no
cleanup) once a counter passes the value of an environment variable, or poison one step's loss."""

from __future__ import annotations

import os

CAPTURE_AFTER_BATCHES = "DRAFTSMITH_FAULT_CAPTURE_AFTER_BATCHES"
TRAIN_AFTER_STEPS = "DRAFTSMITH_FAULT_TRAIN_AFTER_STEPS"
TRAIN_IN_CHECKPOINT = "DRAFTSMITH_FAULT_TRAIN_IN_CHECKPOINT"  # dies inside the write of checkpoint k
TRAIN_NAN_LOSS_AT_STEP = "DRAFTSMITH_FAULT_TRAIN_NAN_LOSS_AT_STEP"  # the loss of optimizer step k becomes NaN
EXIT_CODE = 17


def maybe_die(env: str, count: int) -> None:
    limit = int(os.environ.get(env, "0"))
    if limit and count >= limit:
        os._exit(EXIT_CODE)


def maybe_nan(env: str, count: int, loss):
    """`loss` as NaN at step `count` == the variable's value (a diverging step, on demand)."""
    return loss * float("nan") if int(os.environ.get(env, "0")) == count else loss

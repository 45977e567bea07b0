"""Fault injection for the resume tests: exit abruptly (as a kill would, no cleanup)
once a counter passes the value of an environment variable."""

from __future__ import annotations

import os

CAPTURE_AFTER_BATCHES = "DRAFTSMITH_FAULT_CAPTURE_AFTER_BATCHES"
TRAIN_AFTER_STEPS = "DRAFTSMITH_FAULT_TRAIN_AFTER_STEPS"
TRAIN_IN_CHECKPOINT = "DRAFTSMITH_FAULT_TRAIN_IN_CHECKPOINT"  # dies inside the write of checkpoint k
EXIT_CODE = 17


def maybe_die(env: str, count: int) -> None:
    limit = int(os.environ.get(env, "0"))
    if limit and count >= limit:
        os._exit(EXIT_CODE)

"""The prepared-data folder written by `recipes/prepare.py` and read by capture/training.

<dir>/data/          a `datasets` Arrow dataset: input_ids, loss_mask, length, index (source record)
<dir>/summary.json   counts (records, kept, skipped per reason, tokens), target, template hash
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import DataError

FORMAT = "draftsmith-prepared-v1"


def load_prepared(path: str | Path):
    """(datasets.Dataset, summary dict) of a prepare output folder."""
    from datasets import load_from_disk

    path = Path(path)
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise DataError(f"'{path}' is not a prepared-data folder (no summary.json); run `draftsmith prepare` first")
    summary = json.loads(summary_file.read_text())
    if summary.get("format") != FORMAT:
        raise DataError(f"'{path}/summary.json' has format {summary.get('format')!r}, expected {FORMAT!r}")
    return load_from_disk(str(path / "data")), summary

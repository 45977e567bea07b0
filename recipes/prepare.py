"""Prepare chat data: read -> validate -> (regenerate) -> tokenize with the target's
chat template and an assistant-only loss mask -> an Arrow dataset + summary.json.

    python recipes/prepare.py --config recipes/configs/smollm2-135m/prepare.yaml
    draftsmith prepare --config ... output_dir=runs/prepared max_records=64
"""

from __future__ import annotations

import hashlib
import json
import random
import sys

from tqdm.auto import tqdm

from recipes._common import one_line_errors, parse_args
from trainer.config import PrepareConfig, to_yaml
from trainer.data.chat import (
    SKIP_REASONS,
    BadRecord,
    count_reasons,
    normalize,
    read_template,
    resolve_template,
    tokenize_chat,
)
from trainer.data.prepared import FORMAT
from trainer.data.sources import read_chats
from trainer.errors import DataError
from trainer.io import atomic_write_json, fresh_output_dir, publish_dir, write_run_files


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


def _source_of(index: int, spans) -> str:
    return next((name for name, _, lo, hi in spans if lo <= index < hi), "?")


def _strict_stop(index: int, source: str, reason: str, detail: str = "") -> DataError:
    return DataError(f"record {index} of '{source}' is bad ({reason}: {detail or SKIP_REASONS[reason]}); "
                     "fix or drop it, or set strict=false to skip bad records")


REGENERATED = "regenerated.jsonl"  # in a prepared folder: every answer the target gave


def regenerate_answers(cfg: PrepareConfig, kept: list[dict], template: str, hf_dir, source) -> tuple[list, dict]:
    """The target's answers to every assistant turn of `kept` (trainer/data/regenerate.py's
    records), by the configured engine; and what to record of the run (engine, version,
    settings, throughput). vLLM's work folder (its resume state) is removed once done."""
    import time

    rg = cfg.regenerate
    max_model_len = rg.max_model_len or cfg.max_length
    conversations = [r["messages"] for r in kept]
    total = sum(sum(m["role"] == "assistant" for m in c) for c in conversations)
    settings = {"engine": rg.engine, "dtype": rg.dtype, "max_new_tokens": rg.max_new_tokens, "temperature": rg.temperature,
                "top_p": rg.top_p, "top_k": rg.top_k, "truncated": rg.truncated, "max_model_len": max_model_len,
                "seed": cfg.seed}
    with tqdm(total=total, desc=f"regenerate ({rg.engine})", unit="turn") as bar:
        if rg.engine == "vllm":
            import shutil

            from export.regenerate import regenerate_in_vllm, requests_for, work_dir
            from trainer.target import cache_root

            requests = requests_for(conversations, template, rg, max_model_len, cfg.seed)
            work = work_dir(cache_root() / "regenerate", requests)
            records, report = regenerate_in_vllm(str(hf_dir), requests, work, rg.data_parallel_size,
                                                 vllm_cache=cache_root() / "vllm-cache", progress=bar.update)
            shutil.rmtree(work, ignore_errors=True)
            settings.update(concurrency=rg.concurrency, tensor_parallel_size=rg.tensor_parallel_size,
                            data_parallel_size=rg.data_parallel_size, prefix_caching=rg.prefix_caching)
        else:
            import transformers

            from trainer.data.regenerate import regenerate
            from trainer.target import load_target

            t0 = time.perf_counter()
            target = load_target(cfg.target, rg.dtype, device="cuda" if _has_gpu() else "cpu")
            started = time.perf_counter() - t0
            t0 = time.perf_counter()
            records = regenerate(target, conversations, max_new_tokens=rg.max_new_tokens, max_model_len=max_model_len,
                                 temperature=rg.temperature, top_p=rg.top_p, top_k=rg.top_k, truncated=rg.truncated,
                                 batch_size=rg.batch_size, seed=cfg.seed, chat_template=template,
                                 progress=bar.update)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.get("token_ids", ())) for r in records)
            report = {"engine": "hf", "version": transformers.__version__, "engine_start_s": started,
                      "generate_s": seconds, "tokens_this_run": tokens, "tokens_per_s": tokens / seconds if seconds else 0}
            settings["batch_size"] = rg.batch_size
            del target
    answers = [r for r in records if "skip" not in r]
    return records, {**settings, **report, "answers": len(answers),
                     "tokens": sum(len(r["token_ids"]) for r in answers),
                     "cut_at_max_new_tokens": sum(r["finish_reason"] == "length" for r in answers),
                     "empty": sum(not r["text"] for r in answers),
                     "prompt_too_long": sum("skip" in r for r in records)}


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def run(cfg: PrepareConfig, argv: list[str] | None = None) -> dict:
    from datasets import Dataset

    from trainer.data.sources import resolve_source
    from trainer.io import guard_output
    from trainer.target import content_hash, gguf_to_hf_dir, resolve_target

    read_template(cfg.chat_template, "prepare chat_template")  # a given template is checked before any work
    guard_output(cfg.output_dir, [*(resolve_source(name) for name, _ in source_entries(cfg.source)),
                                  resolve_target(cfg.target).path,
                                  cfg.chat_template if cfg.chat_template and "{" not in cfg.chat_template else None],
                 "prepare", cfg.overwrite)
    tmp = fresh_output_dir(cfg.output_dir, cfg.overwrite)
    try:
        # 1. The target's tokenizer and the chat template, checked before any record is read.
        source = resolve_target(cfg.target)
        digest = content_hash(source)
        from transformers import AutoTokenizer

        hf_dir = gguf_to_hf_dir(source, digest) if source.kind == "gguf" else source.path
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        template = resolve_template(tokenizer, cfg.chat_template, "prepare chat_template", f"target {source.name}")
        # 2. Read and validate records (and regenerate the answers with the target).
        entries = source_entries(cfg.source)
        kept, skipped = [], []  # kept: {"index", "messages"}; skipped: (index, reason)
        from collections import Counter

        dropped = Counter()  # turns dropped from kept conversations, per kind
        seen, spans, reports = set(), [], []  # first user turns so far; (source, first index, end); read reports
        offset = 0
        for name, weight in entries:
            records, report = read_chats(name, cfg.max_records)
            rng = random.Random(f"{cfg.seed}:{name}")  # the weighted subsample, the same every run
            last = -1
            for index, record in tqdm(records, desc=f"read {name}", unit="rec"):
                last = index
                if weight < 1 and rng.random() >= weight:
                    continue
                gi = offset + index  # unique across the mixture: the dataset's `index`
                try:
                    messages = normalize(record, dropped)
                except BadRecord as err:
                    if cfg.strict:
                        raise _strict_stop(index, name, err.reason, err.detail) from None
                    skipped.append((gi, err.reason))
                    continue
                if len(entries) > 1:  # a mixture keeps one conversation per first user turn
                    first = next(m["content"].strip() for m in messages if m["role"] == "user")
                    if first in seen:
                        skipped.append((gi, "duplicate"))
                        continue
                    seen.add(first)
                kept.append({"index": gi, "messages": messages})
            if cfg.strict and report.truncated:
                raise DataError(f"'{name}' ({report.path}) ends mid-record at character {report.truncated_at_byte} "
                                f"after {report.records_read} complete records; strict=true stops here (strict=false "
                                "reads every complete record and says so)")
            spans.append((name, weight, offset, offset + last + 1))
            reports.append(report)
            offset += last + 1

        regenerated = None
        if cfg.regenerate.enabled:
            # a conversation that does not fit max_length as written (or fails tokenizing) is skipped
            # here, for its reason, rather than regenerated to be cut again: most long ones stay long
            fits = []
            for r in tqdm(kept, desc="check before regenerating", unit="conv"):
                try:
                    tokenize_chat(tokenizer, r["messages"], cfg.max_length, template)
                    fits.append(r)
                except BadRecord as err:
                    if cfg.strict:
                        raise _strict_stop(r["index"], _source_of(r["index"], spans), err.reason, err.detail) from None
                    skipped.append((r["index"], err.reason))
            kept = fits
            records, regenerated = regenerate_answers(cfg, kept, template, hf_dir, source)
            from trainer.data.regenerate import apply_answers

            convs, ended, cut = apply_answers([r["messages"] for r in kept], records, cfg.regenerate.truncated)
            skipped += [(kept[c]["index"], reason) for c, reason in ended.items()]
            dropped.update(cut)
            regenerated["records_file"] = REGENERATED
            records = [{"index": kept[r["conv"]]["index"], **r} for r in records]  # the source record, too
            kept = [{**r, "messages": m} for r, m in zip(kept, convs) if m is not None]

        # 3. Tokenize with the chat template and build the assistant loss mask.
        ds = Dataset.from_list(kept) if kept else Dataset.from_dict({"index": [], "messages": []})
        ds = ds.map(_tokenize_batch, batched=True, num_proc=cfg.num_proc if len(ds) > cfg.num_proc else None,
                    fn_kwargs={"tokenizer": tokenizer, "max_length": cfg.max_length,
                               "chat_template": template},
                    remove_columns=["messages"], desc="tokenize")
        late = [(i, *r.split("\t", 1)) for i, r in zip(ds["index"], ds["skip"]) if r]
        if cfg.strict and late:
            first = min(late)
            raise _strict_stop(first[0], _source_of(first[0], spans), first[1], first[2])
        skipped += [(i, reason) for i, reason, _ in late]
        ds = ds.filter(lambda s: not s, input_columns="skip").remove_columns("skip")
        if len(ds) == 0:
            raise DataError(f"no usable conversations in {cfg.source!r} "
                            f"(skipped: {count_reasons(r for _, r in skipped)}); check the source format")

        lengths = list(ds["length"])
        assistant = sum(sum(map(sum, b["loss_mask"])) for b in ds.iter(batch_size=1024))
        kept_index = list(ds["index"])
        per_source = [{"source": name, "weight": weight, "path": r.path, "records_read": r.records_read,
                       "truncated": r.truncated, "kept": sum(lo <= i < hi for i in kept_index),
                       "skipped": count_reasons(reason for i, reason in skipped if lo <= i < hi)}
                      for (name, weight, lo, hi), r in zip(spans, reports)]
        summary = {
            "format": FORMAT,
            "source": cfg.source, "source_path": reports[0].path,
            "records_read": sum(r.records_read for r in reports),
            "source_truncated": any(r.truncated for r in reports),
            "source_notes": [n for r in reports for n in r.notes],
            "sources": per_source,  # per source of a mixture (one entry for a single source)
            "kept": len(ds), "skipped": count_reasons(r for _, r in skipped),
            "dropped_turns": dict(sorted(dropped.items())),
            "tokens": sum(lengths), "assistant_tokens": assistant,
            "max_length": cfg.max_length, "longest": max(lengths),
            "regenerated": cfg.regenerate.enabled,
            **({"regenerate": regenerated} if regenerated else {}),  # engine, version, settings, throughput
            "target": source.name, "target_path": str(source.path), "target_sha256": digest,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            "chat_template": template,  # the text: eval and regeneration of this data's drafts use it
        }
        ds.save_to_disk(str(tmp / "data"))
        if regenerated:  # every answer the target gave (token ids, finish reason): evidence, and what equivalence reads
            with open(tmp / REGENERATED, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        from trainer.data.prepared import data_digest

        summary["data_sha256"] = data_digest(tmp / "data")  # the summary is evidence of this data, checked on load
        atomic_write_json(tmp / "summary.json", summary)
        write_run_files(tmp, to_yaml(cfg), {"target": source.name, "target_sha256": digest, "seed": cfg.seed},
                        argv, stage="prepare")
        publish_dir(tmp, cfg.output_dir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def format_summary(s: dict) -> str:
    skipped = ", ".join(f"{k} {v}" for k, v in s["skipped"].items()) or "none"
    dropped = ", ".join(f"{k} {v}" for k, v in s.get("dropped_turns", {}).items()) or "none"
    lines = [
        f"prepared {s['kept']} conversations from {s['records_read']} records of "
        + ", ".join(f"'{x['source']}'" + (f" (weight {x['weight']:g}: {x['kept']} kept)" if len(s["sources"]) > 1 else "")
                    for x in s["sources"])
        + (" (source file is truncated: every complete record before the break was read)" if s["source_truncated"] else ""),
        f"  skipped: {skipped}",
        f"  turns dropped from kept conversations: {dropped}",
        f"  tokens: {s['tokens']:,} ({s['assistant_tokens']:,} assistant, loss-masked), longest {s['longest']}",
    ]
    return "\n".join(lines)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(PrepareConfig, argv, __doc__, prog="draftsmith prepare")
    summary = run(cfg, argv)
    print(format_summary(summary))
    print(f"  written to {cfg.output_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Prepare chat data: read -> validate -> (regenerate) -> tokenize with the target's
chat template and an assistant-only loss mask -> an Arrow dataset + summary.json.

    python recipes/prepare.py --config recipes/configs/smollm2-135m/prepare.yaml
    draftsmith prepare --config ... output_dir=runs/prepared max_records=64
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import Counter

import torch
import transformers
from tqdm.auto import tqdm

from recipes._common import one_line_errors, parse_args
from trainer.config import PrepareConfig, to_yaml
from trainer.data.chat import BadRecord, count_reasons, read_template, resolve_template, template_file, tokenize_chat
from trainer.data.prepared import tokenize, write_prepared
from trainer.data.regenerate import apply_answers, regenerate
from trainer.data.sources import Chats, read_mixture, resolve_source, source_entries, strict_stop
from trainer.errors import DataError
from trainer.families import served_max_model_len
from trainer.io import fresh_output_dir, guard_output, publish_dir, write_run_files
from trainer.target import TargetSource, cache_root, content_hash, load_target, resolve_target, target_hf_dir
from trainer.vllm.regenerate import regenerate_in_vllm, requests_for, work_dir

WHERE = "prepare chat_template"


def run(cfg: PrepareConfig, argv: list[str] | None = None) -> dict:
    # resolve: the target (once) and a given template, checked before any work
    target = resolve_target(cfg.target)
    read_template(cfg.chat_template, WHERE)
    guard_output(cfg.output_dir, [*(resolve_source(name) for name, _ in source_entries(cfg.source)), target.path,
                                  template_file(cfg.chat_template)],
                 "prepare", cfg.overwrite)
    staging = fresh_output_dir(cfg.output_dir, cfg.overwrite)
    try:
        digest = content_hash(target)
        hf_dir = target_hf_dir(target, digest)
        tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        template = resolve_template(tokenizer, cfg.chat_template, WHERE, f"target {target.name}")
        cfg.max_length, limit_from = length_limit(cfg.max_length, hf_dir, target.name)
        # produce: the conversations, the target's own answers when asked, the token ids
        chats = read_mixture(cfg.source, cfg.max_records, cfg.seed, cfg.strict,
                             progress=lambda records, desc: tqdm(records, desc=desc, unit="rec"))
        records = regenerated = None
        if cfg.regenerate.enabled:
            records, regenerated = regenerate_chats(cfg, chats, tokenizer, template, target, hf_dir)
        ds, late = tokenize(chats.kept, tokenizer, cfg.max_length, template, cfg.num_proc)
        if cfg.strict and late:
            first = min(late)
            raise strict_stop(first[0], chats.source_of(first[0]), first[1], first[2])
        chats.skipped += [(i, reason) for i, reason, _ in late]
        if len(ds) == 0:
            raise DataError(f"no usable conversations in {cfg.source!r} "
                            f"(skipped: {count_reasons(r for _, r in chats.skipped)}); {nothing_left_advice(chats)}")
        # publish: the data and its summary, then the folder in one rename
        summary = write_prepared(staging, ds, chats, source=cfg.source, max_length=cfg.max_length,
                                 max_length_from=limit_from,
                                 regenerated=regenerated, records=records, target=target, target_sha256=digest,
                                 chat_template=template)
        write_run_files(staging, to_yaml(cfg), {"target": target.name, "target_sha256": digest, "seed": cfg.seed},
                        argv, stage="prepare")
        publish_dir(staging, cfg.output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def length_limit(max_length: int | None, hf_dir, name: str) -> tuple[int, str]:
    """(the tokens a conversation may have, where that limit comes from): `max_length`, or null
    for the target's context; one line when max_length asks for more than the target takes."""
    context = int(transformers.AutoConfig.from_pretrained(hf_dir).get_text_config().max_position_embeddings)
    if max_length is None:
        return context, "the target's context (max_position_embeddings)"
    if max_length > context:
        raise DataError(f"max_length {max_length} is longer than {name}'s context, {context} tokens "
                        f"(max_position_embeddings in its config.json); use at most {context}, or null for it")
    return max_length, "max_length"


# what to do when every conversation was skipped for one of these (the most frequent reason decides)
ADVICE = {"too_long": "raise max_length, or use shorter conversations",
          "regenerate_prompt_too_long": "raise regenerate.max_model_len (the prompts leave no room for an answer)",
          "regenerate_answer_truncated": "raise regenerate.max_new_tokens, or keep cut answers "
                                         "(regenerate.truncated=keep)",
          "regenerate_empty_answer": "check the target's chat template and generation settings (its answers are "
                                     "empty)",
          "duplicate": "every conversation repeats an earlier one: add other sources"}


def nothing_left_advice(chats: Chats) -> str:
    """What to change when prepare kept nothing: said by the most frequent reason it skipped one
    (a setting, when a setting skipped them; the source's format otherwise)."""
    reasons = Counter(r for _, r in chats.skipped)
    top = reasons.most_common(1)[0][0] if reasons else None
    return ADVICE.get(top, "check the source format")


def regenerate_chats(cfg: PrepareConfig, chats: Chats, tokenizer, template: str, target: TargetSource,
                     hf_dir) -> tuple[list, dict]:
    """Every assistant turn of `chats` replaced by the target's own answer (in place), by the
    configured engine: the records (trainer/data/regenerate.py's, each with its source record's
    index) and what to record of the run (engine, version, settings, throughput). A conversation
    that does not fit max_length as written is skipped for its reason before, not cut after."""
    fits = []
    for r in tqdm(chats.kept, desc="check before regenerating", unit="conv"):
        try:
            tokenize_chat(tokenizer, r["messages"], cfg.max_length, template)
            fits.append(r)
        except BadRecord as err:
            if cfg.strict:
                raise strict_stop(r["index"], chats.source_of(r["index"]), err.reason, err.detail) from None
            chats.skipped.append((r["index"], err.reason))
    chats.kept = fits
    records, report = answer(cfg, [r["messages"] for r in fits], template, target, hf_dir)
    convs, ended, cut = apply_answers([r["messages"] for r in fits], records, cfg.regenerate.truncated)
    chats.skipped += [(fits[c]["index"], reason) for c, reason in ended.items()]
    chats.dropped.update(cut)
    records = [{"index": fits[r["conv"]]["index"], **r} for r in records]  # the source record, too
    chats.kept = [{**r, "messages": m} for r, m in zip(fits, convs) if m is not None]
    return records, report


def answer(cfg: PrepareConfig, conversations: list[list[dict]], template: str, source: TargetSource,
           hf_dir) -> tuple[list, dict]:
    """The target's answers to every assistant turn (records in conversation and turn order) by
    the configured engine, and the run's report. vLLM's work folder (its resume state) is
    removed once done."""
    rg = cfg.regenerate
    max_model_len = rg.max_model_len or cfg.max_length
    total = sum(sum(m["role"] == "assistant" for m in c) for c in conversations)
    settings = {"engine": rg.engine, "dtype": rg.dtype, "max_new_tokens": rg.max_new_tokens,
                "temperature": rg.temperature,
                "top_p": rg.top_p, "top_k": rg.top_k, "truncated": rg.truncated, "max_model_len": max_model_len,
                "seed": cfg.seed}
    with tqdm(total=total, desc=f"regenerate ({rg.engine})", unit="turn") as bar:
        if rg.engine == "vllm":
            engine_len = served_max_model_len(transformers.AutoConfig.from_pretrained(hf_dir).get_text_config(),
                                              max_model_len)
            requests = requests_for(conversations, template, rg, max_model_len, cfg.seed,
                                    engine_max_model_len=engine_len)
            work = work_dir(cache_root() / "regenerate", requests)
            records, report = regenerate_in_vllm(str(hf_dir), requests, work, rg.data_parallel_size,
                                                 progress=bar.update)
            shutil.rmtree(work, ignore_errors=True)
            settings.update(concurrency=rg.concurrency, tensor_parallel_size=rg.tensor_parallel_size,
                            data_parallel_size=rg.data_parallel_size, prefix_caching=rg.prefix_caching)
        else:
            t0 = time.perf_counter()
            target = load_target(source, rg.dtype, device="cuda" if torch.cuda.is_available() else "cpu")
            started = time.perf_counter() - t0
            t0 = time.perf_counter()
            records = regenerate(target, conversations, max_new_tokens=rg.max_new_tokens, max_model_len=max_model_len,
                                 temperature=rg.temperature, top_p=rg.top_p, top_k=rg.top_k, truncated=rg.truncated,
                                 batch_size=rg.batch_size, seed=cfg.seed, chat_template=template,
                                 progress=bar.update)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.get("token_ids", ())) for r in records)
            report = {"engine": "hf", "version": transformers.__version__, "engine_start_s": started,
                      "generate_s": seconds, "tokens_this_run": tokens,
                      "tokens_per_s": tokens / seconds if seconds else 0}
            settings["batch_size"] = rg.batch_size
            del target
    answers = [r for r in records if "skip" not in r]
    return records, {**settings, **report, "answers": len(answers),
                     "tokens": sum(len(r["token_ids"]) for r in answers),
                     "cut_at_max_new_tokens": sum(r["finish_reason"] == "length" for r in answers),
                     "empty": sum(not r["text"] for r in answers),
                     "prompt_too_long": sum("skip" in r for r in records), "records_file": "regenerated.jsonl"}


def format_summary(s: dict) -> str:
    skipped = ", ".join(f"{k} {v}" for k, v in s["skipped"].items()) or "none"
    dropped = ", ".join(f"{k} {v}" for k, v in s.get("dropped_turns", {}).items()) or "none"
    lines = [
        f"prepared {s['kept']} conversations from {s['records_read']} records of "
        + ", ".join(f"'{x['source']}'"
                    + (f" (weight {x['weight']:g}: {x['kept']} kept)" if len(s["sources"]) > 1 else "")
                    for x in s["sources"])
        + (" (source file is truncated: every complete record before the break was read)"
           if s["source_truncated"] else ""),
        f"  skipped: {skipped}",
        f"  turns dropped from kept conversations: {dropped}",
        f"  tokens: {s['tokens']:,} ({s['assistant_tokens']:,} assistant, loss-masked), longest {s['longest']}",
    ]
    if s["skipped"].get("too_long"):  # the length limit, named where it bites
        lines.append(f"  {s['skipped']['too_long']} conversations longer than max_length {s['max_length']} tokens "
                     f"({s.get('max_length_from', 'max_length')}) skipped, not cut (reason too_long)")
    return "\n".join(lines)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(PrepareConfig, argv, __doc__, prog="draftsmith prepare")
    summary = run(cfg, argv)
    print(format_summary(summary))
    print(f"  written to {cfg.output_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])

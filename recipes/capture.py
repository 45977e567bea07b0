"""Capture multi-layer hidden states of the frozen target over prepared chat data.

    python recipes/capture.py --config recipes/configs/smollm2-135m/capture.yaml
    accelerate launch --num_processes 2 recipes/capture.py --config ...   (data-parallel)

Shard k holds samples [k*S, (k+1)*S) and is computed by rank k % world_size, so
the shards do not depend on the number of processes. A killed capture restarts
where it stopped (complete shards are kept, checked by sha256) and ends with the
same shards as an uninterrupted run. The draft vocabulary (d2t/t2d) is built
from the loss-masked tokens of the captured samples.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from recipes._common import one_line_errors, parse_args
from trainer import faults
from trainer.capture import sample_states, token_budget_batches
from trainer.config import CaptureConfig, to_yaml
from trainer.data.prepared import load_prepared
from trainer.data.shards import (
    MANIFEST,
    bytes_per_token,
    completed_shard,
    load_manifest,
    pack_samples,
    shard_name,
    verify_capture,
    write_manifest,
    write_shard,
)
from trainer.data.vocab import token_counts
from trainer.dist import process_state
from trainer.drafts.registry import VLLM_METHOD, get
from trainer.errors import DataError, DraftsmithError
from trainer.io import (
    atomic_write_json,
    claim_output,
    disk_free,
    ensure_dir,
    guard_output,
    human_bytes,
    sha256_file,
    write_run_files,
)
from trainer.io import check_space as io_check_space
from trainer.target import (
    TargetSource,
    cache_root,
    content_hash,
    load_target,
    parse_dtype,
    resolve_target,
    target_hf_dir,
)
from trainer.vllm.capture import capture_in_vllm
from trainer.vllm.servable import check_servable, check_vllm_capture

STATE = "capture_state.json"


def _open_output(out: Path, cfg: CaptureConfig, fingerprint: dict) -> None:
    """Make `out` ready: new, emptied (overwrite) or a capture of this config to resume."""
    state_file = out / STATE
    if out.exists() and cfg.overwrite:
        shutil.rmtree(out)
    if out.exists():
        if not state_file.is_file():
            raise DraftsmithError(f"output_dir '{out}' exists and is not a capture; pass overwrite=true to replace it")
        previous = json.loads(state_file.read_text())
        if not cfg.resume:
            raise DraftsmithError(f"output_dir '{out}' holds a capture; pass resume=true to continue it "
                                  "or overwrite=true to start again")
        if previous != fingerprint:
            changed = sorted(k for k in {*previous, *fingerprint} if previous.get(k) != fingerprint.get(k))
            raise DraftsmithError(f"output_dir '{out}' holds a capture made with other settings "
                                  f"({', '.join(changed)}); "
                                  "use another output_dir or overwrite=true")
        for stale in out.glob(".*.tmp"):  # partial writes of a killed run
            stale.unlink()
        return
    ensure_dir(out, "output_dir")
    claim_output(out, "capture")  # overwrite=true may replace what a killed capture leaves
    atomic_write_json(state_file, fingerprint)


def capture_layer_ids(cfg: CaptureConfig, num_layers: int) -> tuple[list[int], dict[str, list[int]]]:
    """(the ids to store, each draft's ids). Explicit `aux_layer_ids` serve every listed draft;
    otherwise each draft's default for this target, stored once as their sorted union."""
    if cfg.aux_layer_ids is not None:
        ids = list(cfg.aux_layer_ids)
        return ids, {name: ids for name in cfg.drafts}
    per_draft = {name: get(name).default_layer_ids(num_layers) for name in cfg.drafts}
    return sorted({i for ids in per_draft.values() for i in ids}), per_draft


@dataclass
class Plan:
    """What this capture stores and where: the layer ids (stored, and each draft's), the shards
    (k -> its prepared rows), what it must match to resume (fingerprint) and what a token costs."""

    layer_ids: list[int]
    draft_layer_ids: dict[str, list[int]]
    samples: int
    shards: dict[int, range]
    lengths: list[int]
    fingerprint: dict
    bytes_per_token: float
    too_long: dict | None = None  # the length limit and the prepared samples it skipped (fit_lengths)


def run(cfg: CaptureConfig, argv: list[str] | None = None) -> dict:
    state = process_state()
    # resolve: the target (once), the prepared data
    source = resolve_target(cfg.target)
    out = guard_output(cfg.output_dir, [cfg.data, source.path], "capture", cfg.overwrite)
    if cfg.engine == "vllm":  # vLLM hands states out only through the interface a draft reads: refused up front
        check_vllm_capture(source)
    warnings = check_servable(source, [VLLM_METHOD[a] for a in cfg.drafts], cfg.require_servable, "capture")
    for line in warnings if state.is_main_process else ():  # before any work
        print(line, file=sys.stderr)
    ds, prepared = load_prepared(cfg.data)
    if cfg.engine == "vllm" and state.num_processes > 1:
        raise DraftsmithError(f"engine=vllm runs its own engines (data_parallel_size={cfg.data_parallel_size}); start "
                              f"it with python, not {state.num_processes} launched processes")
    if cfg.estimate:
        return estimate(cfg, source, out, ds)
    # vLLM runs the target itself: here only its tokenizer, config and head (for the checks) are read
    target = load_target(source, cfg.target_dtype, state.device, head_only=cfg.engine == "vllm")
    # check: the data is this target's, the layers exist, the shards still to write fit
    check_data(cfg, target, ds, prepared)
    ds, too_long = fit_lengths(cfg, target, ds, state.is_main_process)
    plan = make_plan(cfg, target, ds)
    plan.fingerprint["max_length"], plan.too_long = too_long["max_length"], too_long
    if state.is_main_process:
        remaining = [k for k in plan.shards if not (out / MANIFEST).is_file()
                     and not (out / shard_name(k)).with_suffix(".json").is_file()]  # (verified later, hashed once)
        need = sum(plan.lengths[i] for k in remaining for i in plan.shards[k]) * plan.bytes_per_token
        if cfg.engine == "vllm" and remaining:  # vLLM's connector stages a shard's states (every layer, in
            staged = max(sum(plan.lengths[i] for i in plan.shards[k]) for k in remaining)  # target_dtype) first
            need += staged * (len(plan.layer_ids) + 1) * target.hidden_size * parse_dtype(cfg.target_dtype).itemsize
        check_space(out, need + vocab_bytes(target.vocab_size))
        _open_output(out, cfg, plan.fingerprint)
        check_finished(out)
    state.wait_for_everyone()
    done = (out / MANIFEST).is_file()
    # produce: this process's shards still to do (all of them for vLLM's engines)
    workers = 1 if cfg.engine == "vllm" else state.num_processes
    todo = [] if done else [k for k in range(state.process_index, len(plan.shards), workers)
                            if completed_shard(out, k) is None]
    t0 = time.perf_counter()
    run_report, tokens_done = produce(cfg, target, ds, plan, out, todo, state)
    elapsed = time.perf_counter() - t0
    state.wait_for_everyone()
    # publish: the draft vocabulary and the manifest, once every shard is in
    if state.is_main_process and not done:
        publish(cfg, target, ds, prepared, plan, out, run_report, argv, state.num_processes)
    state.wait_for_everyone()
    manifest = json.loads((out / MANIFEST).read_text())
    seconds = run_report.get("capture_s", elapsed)  # vLLM: without its engine start
    manifest["run"] = {"already_complete": done, "tokens_this_process": tokens_done, "seconds": elapsed,
                       "tokens_per_s": tokens_done / seconds if seconds > 0 else 0.0,
                       **({"engine_start_s": run_report["engine_start_s"]} if "engine_start_s" in run_report else {})}
    if state.is_main_process and tokens_done and not done:
        record_speed(target.content_hash, cfg, tokens_done * workers / seconds if seconds > 0 else 0.0)
    return manifest


def check_finished(out: Path) -> None:
    """A finished capture (its manifest there) is complete only while every shard matches its
    size and sha256 in the manifest: one line naming the first that does not."""
    if not (out / MANIFEST).is_file():
        return
    for entry in load_manifest(out).manifest["shards"]:
        p = out / entry["file"]
        if not p.is_file() or p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            raise DataError(f"capture '{out}' is finished, but its shard {entry['file']} is "
                            + ("missing" if not p.is_file() else f"corrupt (it does not match its size/sha256 in "
                                                                 f"{MANIFEST})")
                            + "; pass overwrite=true to capture again")


def check_data(cfg: CaptureConfig, target, ds, prepared: dict) -> None:
    """The prepared data was made for this target, with ids its vocabulary has."""
    if prepared["target_sha256"] != target.content_hash:
        raise DataError(f"'{cfg.data}' was prepared with target {prepared['target']} "
                        f"({prepared['target_sha256'][:12]}), "
                        f"not {target.name} ({target.content_hash[:12]}); re-run prepare with this target")
    largest = max(max(ids) for b in ds.iter(batch_size=1024) for ids in b["input_ids"])
    if largest >= target.vocab_size:  # another tokenizer's ids under this summary
        raise DataError(f"'{cfg.data}' holds token id {largest}, but {target.name}'s vocabulary has "
                        f"{target.vocab_size} "
                        "ids: it was not tokenized for this target; run `draftsmith prepare` with it")


def fit_lengths(cfg: CaptureConfig, target, ds, say: bool) -> tuple:
    """The prepared samples of at most max_length tokens (null: the target's context), and what
    the limit skipped: {"max_length", "from", "skipped", "longest_skipped"}. A longer sample is
    skipped, never cut; `say`: one line naming the limit when it bites."""
    context = int(target.model.config.get_text_config().max_position_embeddings)
    limit, whence = (cfg.max_length, "max_length") if cfg.max_length is not None else \
        (context, "the target's context (max_position_embeddings)")
    lengths = list(ds["length"])
    over = [i for i, n in enumerate(lengths) if n > limit]
    report = {"max_length": limit, "from": whence, "skipped": len(over),
              "longest_skipped": max((lengths[i] for i in over), default=None)}
    if not over:
        return ds, report
    if len(over) == len(lengths):
        raise DataError(f"every sample of '{cfg.data}' is longer than max_length {limit} tokens ({whence}); raise "
                        "max_length or prepare with a smaller one")
    if say:
        print(f"capture: {len(over)} of {len(lengths)} prepared samples are longer than max_length {limit} tokens "
              f"({whence}; the longest {report['longest_skipped']}): skipped, not cut, counted in the manifest",
              file=sys.stderr)
    keep = set(over)
    return ds.select([i for i in range(len(lengths)) if i not in keep]), report


def make_plan(cfg: CaptureConfig, target, ds) -> Plan:
    layer_ids, draft_layer_ids = capture_layer_ids(cfg, target.num_layers)
    target.check_layer_ids(layer_ids)
    n = min(len(ds), cfg.max_samples or len(ds))
    fingerprint = {
        "target_sha256": target.content_hash, "data_summary_sha256": hashlib.sha256(
            (Path(cfg.data) / "summary.json").read_bytes()).hexdigest(),
        "aux_layer_ids": layer_ids, "draft_layer_ids": draft_layer_ids, "target_dtype": cfg.target_dtype,
        "store_dtype": cfg.store_dtype, "samples": n, "samples_per_shard": cfg.samples_per_shard,
        "max_tokens_per_batch": cfg.max_tokens_per_batch, "draft_vocab_size": cfg.draft_vocab_size,
        "engine": cfg.engine,
    }
    S = cfg.samples_per_shard
    shards = {k: range(k * S, min((k + 1) * S, n)) for k in range(math.ceil(n / S))}
    return Plan(layer_ids, draft_layer_ids, n, shards, list(ds.select(range(n))["length"]), fingerprint,
                bytes_per_token(len(layer_ids), target.hidden_size, cfg.store_dtype))


def produce(cfg: CaptureConfig, target, ds, plan: Plan, out: Path, todo: list[int], state) -> tuple[dict, int]:
    """Shards `todo` written into `out`, by vLLM's engines or by the target here, batch by batch
    (token-budget batches, longest first: the same batches on every run). Returns (the run's
    report, tokens captured)."""
    total = sum(plan.lengths[i] for k in todo for i in plan.shards[k])
    with tqdm(total=total, unit="tok", unit_scale=True, desc=f"capture[{state.process_index}] ({cfg.engine})",
              disable=not state.is_local_main_process) as bar:
        if cfg.engine == "vllm":
            if not todo:
                return {"engine": "vllm"}, 0
            report = capture_in_vllm(target.hf_dir, out, {k: plan.shards[k] for k in todo}, ds, plan.layer_ids,
                                     target.num_layers, cfg, progress=bar.update)
            return report, report["tokens"]
        pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
        batches_run, tokens = 0, 0
        for k in todo:
            shard = ds.select(plan.shards[k])
            ids, masks = shard["input_ids"], shard["loss_mask"]
            records = shard["index"] if "index" in shard.column_names else [None] * len(ids)
            names = [f"{row} of '{cfg.data}'" + (f" (source record {r})" if r is not None else "")
                     for row, r in zip(plan.shards[k], records)]  # the prepared row, and the record it came from
            samples: list[dict | None] = [None] * len(ids)
            for batch in token_budget_batches([len(x) for x in ids], cfg.max_tokens_per_batch):
                made = sample_states(target, [ids[i] for i in batch], pad, plan.layer_ids, cfg.store_dtype,
                                     [names[i] for i in batch])  # the loop online training runs too
                for i, states in zip(batch, made):
                    samples[i] = {"input_ids": torch.tensor(ids[i]), "loss_mask": torch.tensor(masks[i]), **states}
                    tokens += len(ids[i])
                    bar.update(len(ids[i]))
                batches_run += 1
                faults.maybe_die(faults.CAPTURE_AFTER_BATCHES, batches_run)  # tests: a kill mid-shard
            write_shard(out, k, pack_samples(samples, list(plan.shards[k])), plan.layer_ids)
    return {"engine": "hf"}, tokens


def publish(cfg: CaptureConfig, target, ds, prepared: dict, plan: Plan, out: Path, run_report: dict, argv,
            world_size: int) -> None:
    """Every shard checked complete, then the run files, the draft vocabulary and the manifest (last)."""
    entries = []
    for k in plan.shards:
        entry = completed_shard(out, k)
        if entry is None:
            raise DataError(f"capture '{out}': shard {shard_name(k)} is missing or corrupt after the run")
        entries.append(entry)
    counts = sum(token_counts(b["input_ids"], b["loss_mask"], target.vocab_size)
                 for b in ds.select(range(plan.samples)).iter(batch_size=1024))
    write_run_files(out, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash,
                                        "seed": cfg.seed, "world_size": world_size}, argv, stage="capture")
    write_manifest(out, target=target, target_dtype=cfg.target_dtype, layer_ids=plan.layer_ids,
                   draft_layer_ids=plan.draft_layer_ids, store_dtype=cfg.store_dtype,
                   engine={k: v for k, v in run_report.items() if k in ("engine", "version", "engines")},
                   data={"path": str(cfg.data), "source": prepared["source"], "regenerated": prepared["regenerated"],
                         "chat_template_sha256": prepared["chat_template_sha256"],
                         "chat_template": prepared.get("chat_template")},  # the text: eval of its drafts uses it
                   samples=plan.samples, entries=entries, counts=counts, draft_vocab_size=cfg.draft_vocab_size,
                   too_long=plan.too_long)


def vocab_bytes(vocab_size: int) -> int:
    """draft_vocab.safetensors at most (d2t int64 [<=V], t2d bool [V], counts int64 [V]) and the json files."""
    return vocab_size * 17 + (1 << 16)


def check_space(out: Path, need: float) -> None:
    io_check_space(out, need, f"capture into '{out}'", "capture fewer samples (max_samples), store float8_e4m3 "
                   "(half of bfloat16), or choose another output_dir")


SPEED = "capture_speed.json"  # in the cache: the last measured tokens/s per target, engine and dtype


def _speed_key(target_sha256: str, cfg: CaptureConfig) -> str:
    return f"{target_sha256}|{cfg.engine}|{cfg.target_dtype}"


def record_speed(target_sha256: str, cfg: CaptureConfig, tokens_per_s: float) -> None:
    f = cache_root() / SPEED
    try:
        known = json.loads(f.read_text()) if f.is_file() else {}
    except (ValueError, OSError):
        known = {}
    known[_speed_key(target_sha256, cfg)] = {"tokens_per_s": tokens_per_s, "measured": time.strftime("%Y-%m-%d %H:%M")}
    try:
        ensure_dir(f.parent, "cache")
        atomic_write_json(f, known)
    except (OSError, DraftsmithError):
        pass  # an estimate without a measured speed says so


def estimate(cfg: CaptureConfig, source: TargetSource, out: Path, ds) -> dict:
    """What the capture will cost, before anything runs: bytes per token and on disk for these
    samples and layers, the time at the last tokens/s measured for this target, engine and dtype
    on this machine, and whether it fits on the output's filesystem. Loads the target's config only."""
    digest = content_hash(source)
    t = AutoConfig.from_pretrained(target_hf_dir(source, digest)).get_text_config()
    layer_ids, _ = capture_layer_ids(cfg, t.num_hidden_layers)
    n = min(len(ds), cfg.max_samples or len(ds))
    tokens = sum(ds.select(range(n))["length"])
    bpt = bytes_per_token(len(layer_ids), t.hidden_size, cfg.store_dtype)
    need = tokens * bpt + vocab_bytes(t.vocab_size)
    try:
        speed = json.loads((cache_root() / SPEED).read_text()).get(_speed_key(digest, cfg))
    except (ValueError, OSError):
        speed = None
    return {"estimate": True, "samples": n, "tokens": tokens, "aux_layer_ids": layer_ids, "hidden_size": t.hidden_size,
            "store_dtype": cfg.store_dtype, "bytes_per_token": bpt, "bytes": need, "free_bytes": disk_free(out),
            "engine": cfg.engine, "tokens_per_s": speed and speed["tokens_per_s"],
            "measured": speed and speed["measured"], "seconds": speed and tokens / speed["tokens_per_s"]}


def format_estimate(e: dict) -> str:
    fits = e["bytes"] <= e["free_bytes"]
    when = (f"about {e['seconds'] / 3600:.2f} h at {e['tokens_per_s']:,.0f} tokens/s (measured here {e['measured']}, "
            f"{e['engine']} engine)") if e["seconds"] else \
        f"unknown: no {e['engine']} capture of this target in this dtype has been measured on this machine yet"
    return "\n".join([
        f"capture estimate: {e['samples']} samples, {e['tokens']:,} tokens, aux layer ids {e['aux_layer_ids']} + the "
        f"last layer, H={e['hidden_size']}, stored {e['store_dtype']}",
        f"  bytes/token {e['bytes_per_token']:,.1f} ({e['bytes_per_token'] / 1024:.2f} KiB); on disk "
        f"{human_bytes(e['bytes'])}; the output's filesystem has {human_bytes(e['free_bytes'])} free: "
        + ("fits" if fits else "DOES NOT FIT (the capture would refuse to start)"),
        f"  time: {when}",
    ])


def format_summary(m: dict) -> str:
    bpt = m["bytes_per_token"]
    run = m.get("run", {})
    lines = [
        f"captured {m['samples']} samples, {m['tokens']:,} tokens ({m['loss_tokens']:,} loss-masked) "
        f"in {len(m['shards'])} shard(s) from {m['target']['name']}",
        f"  engine {m.get('engine', {}).get('engine', 'hf')}"
        + (f" (vLLM {m['engine']['version']})" if m.get("engine", {}).get("version") else "")
        + f"; aux layer ids {m['aux_layer_ids']} ({m['layer_id_convention']}; "
        + ", ".join(f"{k}: {v}" for k, v in m["draft_layer_ids"].items()) + "), "
        f"H={m['target']['hidden_size']}, stored {m['store_dtype']}",
        f"  bytes/token on disk {bpt['on_disk']:.1f} (expected {bpt['expected']:.1f})",
        f"  draft vocab: {m['draft_vocab']['size']} tokens cover {100 * m['draft_vocab']['coverage']:.2f}% "
        "of loss-masked tokens",
    ]
    if (m.get("too_long") or {}).get("skipped"):
        t = m["too_long"]
        lines.append(f"  {t['skipped']} prepared samples longer than max_length {t['max_length']} tokens ({t['from']}) "
                     "skipped, not cut")
    if run.get("already_complete"):
        lines.append("  (already complete: nothing to do)")
    elif run:
        lines.append(f"  throughput {run['tokens_per_s']:,.0f} tokens/s (this process)")
    return "\n".join(lines)


@one_line_errors
def inspect_main(argv: list[str]) -> None:
    """`draftsmith inspect-capture DIR`: verify a capture and print its summary."""
    ap = argparse.ArgumentParser(prog="draftsmith inspect-capture",
                                 description="Verify a capture against its manifest (every shard's size, sha256, "
                                             "tensors and layer ids; every stored state finite; the draft "
                                             "vocabulary) and print its summary.")
    ap.add_argument("capture_dir", help="the output_dir of `draftsmith capture`")
    info = verify_capture(ap.parse_args(argv).capture_dir, states=True)
    print(format_summary(info.manifest))
    print(f"  all {len(info.manifest['shards'])} shard(s) match their sha256; every stored state is finite")


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(CaptureConfig, argv, __doc__, prog="draftsmith capture")
    manifest = run(cfg, argv)
    if manifest.get("estimate"):
        print(format_estimate(manifest))
    elif process_state().is_main_process:
        print(format_summary(manifest))
        print(f"  written to {cfg.output_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])

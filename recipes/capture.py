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

import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from recipes._common import one_line_errors, parse_args
from trainer import faults
from trainer.capture import capture_batch, right_pad, token_budget_batches
from trainer.config import CaptureConfig, to_yaml
from trainer.data.prepared import load_prepared
from trainer.data.shards import (
    DRAFT_VOCAB,
    FORMAT,
    MANIFEST,
    bytes_per_token,
    completed_shard,
    pack_samples,
    shard_name,
    store_states,
    write_shard,
)
from trainer.data.vocab import build_draft_vocab, coverage, token_counts
from trainer.dist import process_state
from trainer.errors import DataError, DraftsmithError
from trainer.io import atomic_save_safetensors, atomic_write_json, claim_output, ensure_dir, write_run_files
from trainer.layer_ids import LAYER_ID_CONVENTION
from trainer.target import load_target

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
            raise DraftsmithError(f"output_dir '{out}' holds a capture made with other settings ({', '.join(changed)}); "
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
    from trainer.drafts import get

    if cfg.aux_layer_ids is not None:
        ids = list(cfg.aux_layer_ids)
        return ids, {name: ids for name in cfg.drafts}
    per_draft = {name: get(name).default_layer_ids(num_layers) for name in cfg.drafts}
    return sorted({i for ids in per_draft.values() for i in ids}), per_draft


def run(cfg: CaptureConfig, argv: list[str] | None = None) -> dict:
    from export.servable import check_servable
    from trainer.io import guard_output
    from trainer.target import resolve_target

    state = process_state()
    out = guard_output(cfg.output_dir, [cfg.data, resolve_target(cfg.target).path], "capture", cfg.overwrite)
    for line in check_servable(cfg.target, cfg.drafts, cfg.require_servable, "capture"):  # before any work
        if state.is_main_process:
            print(line, file=sys.stderr)
    ds, prepared = load_prepared(cfg.data)
    if cfg.engine == "vllm" and state.num_processes > 1:
        raise DraftsmithError(f"engine=vllm runs its own engines (data_parallel_size={cfg.data_parallel_size}); start "
                              f"it with python, not {state.num_processes} launched processes")
    if cfg.estimate:
        return estimate(cfg, out, ds)
    # vLLM runs the target itself: here only its tokenizer, config and head (for the checks) are read
    target = load_target(cfg.target, cfg.target_dtype, state.device, head_only=cfg.engine == "vllm")
    if prepared["target_sha256"] != target.content_hash:
        raise DataError(f"'{cfg.data}' was prepared with target {prepared['target']} ({prepared['target_sha256'][:12]}), "
                        f"not {target.name} ({target.content_hash[:12]}); re-run prepare with this target")
    largest = max(max(ids) for b in ds.iter(batch_size=1024) for ids in b["input_ids"])
    if largest >= target.vocab_size:  # another tokenizer's ids under this summary
        raise DataError(f"'{cfg.data}' holds token id {largest}, but {target.name}'s vocabulary has {target.vocab_size} "
                        "ids: it was not tokenized for this target; run `draftsmith prepare` with it")
    layer_ids, draft_layer_ids = capture_layer_ids(cfg, target.num_layers)
    target.check_layer_ids(layer_ids)
    n = min(len(ds), cfg.max_samples or len(ds))
    fingerprint = {
        "target_sha256": target.content_hash, "data_summary_sha256": hashlib.sha256(
            (Path(cfg.data) / "summary.json").read_bytes()).hexdigest(),
        "aux_layer_ids": layer_ids, "draft_layer_ids": draft_layer_ids, "target_dtype": cfg.target_dtype, "store_dtype": cfg.store_dtype,
        "samples": n, "samples_per_shard": cfg.samples_per_shard, "max_tokens_per_batch": cfg.max_tokens_per_batch,
        "draft_vocab_size": cfg.draft_vocab_size, "engine": cfg.engine,
    }
    num_shards = math.ceil(n / cfg.samples_per_shard)
    rows = {k: range(k * cfg.samples_per_shard, min((k + 1) * cfg.samples_per_shard, n)) for k in range(num_shards)}
    lengths = list(ds.select(range(n))["length"])
    bpt = bytes_per_token(len(layer_ids), target.hidden_size, cfg.store_dtype)
    if state.is_main_process:
        # the shards still to write must fit beside what is there: one line before any work otherwise
        remaining = [k for k in range(num_shards) if not (out / MANIFEST).is_file()
                     and not (out / shard_name(k)).with_suffix(".json").is_file()]  # (verified later, hashed once)
        check_space(out, sum(lengths[i] for k in remaining for i in rows[k]) * bpt + vocab_bytes(target.vocab_size))
        _open_output(out, cfg, fingerprint)
    state.wait_for_everyone()
    done = (out / MANIFEST).is_file()

    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    workers = 1 if cfg.engine == "vllm" else state.num_processes  # vLLM's engines are its own
    todo = [] if done else [k for k in range(state.process_index, num_shards, workers) if completed_shard(out, k) is None]
    total = sum(lengths[i] for k in todo for i in rows[k])
    batches_run, tokens_done, t0 = 0, 0, time.perf_counter()
    run_report = {"engine": "hf"}
    with tqdm(total=total, unit="tok", unit_scale=True, desc=f"capture[{state.process_index}] ({cfg.engine})",
              disable=not state.is_local_main_process) as bar:
        if cfg.engine == "vllm" and todo:
            from export.capture import capture_in_vllm
            from trainer.target import cache_root

            run_report = capture_in_vllm(target.hf_dir, out, {k: rows[k] for k in todo}, ds, layer_ids,
                                         target.num_layers, cfg, progress=bar.update,
                                         vllm_cache=cache_root() / "vllm-cache")
            tokens_done = run_report["tokens"]
        for k in todo if cfg.engine == "hf" else ():
            shard = ds.select(rows[k])
            ids, masks = shard["input_ids"], shard["loss_mask"]
            samples: list[dict | None] = [None] * len(ids)
            for batch in token_budget_batches([len(x) for x in ids], cfg.max_tokens_per_batch):
                input_ids, attention_mask = right_pad([ids[i] for i in batch], pad)  # [B, T]
                states = capture_batch(target, input_ids, attention_mask, layer_ids)
                stored = {k: v.cpu() for k, v in store_states(states["aux_hidden_states"], states["last_hidden_state"],
                                                              cfg.store_dtype).items()}
                argmax = states["target_argmax"].cpu()
                for r, i in enumerate(batch):
                    T = len(ids[i])
                    samples[i] = {"input_ids": torch.tensor(ids[i]), "loss_mask": torch.tensor(masks[i]),
                                  "target_argmax": argmax[r, :T], **{k: v[r, :T] for k, v in stored.items()}}
                    tokens_done += T
                    bar.update(T)
                batches_run += 1
                faults.maybe_die(faults.CAPTURE_AFTER_BATCHES, batches_run)  # tests: a kill mid-shard
            write_shard(out, k, pack_samples(samples, list(rows[k])), layer_ids)
    elapsed = time.perf_counter() - t0
    state.wait_for_everyone()

    if state.is_main_process and not done:
        entries = []
        for k in range(num_shards):
            entry = completed_shard(out, k)
            if entry is None:
                raise DataError(f"capture '{out}': shard {shard_name(k)} is missing or corrupt after the run")
            entries.append(entry)
        counts = sum(token_counts(b["input_ids"], b["loss_mask"], target.vocab_size)
                     for b in ds.select(range(n)).iter(batch_size=1024))
        d2t, t2d = build_draft_vocab(counts, min(cfg.draft_vocab_size, target.vocab_size))
        atomic_save_safetensors(out / DRAFT_VOCAB, {"d2t": d2t, "t2d": t2d, "counts": counts})
        tokens = sum(e["tokens"] for e in entries)
        manifest = {
            "format": FORMAT,
            "target": {"name": target.name, "path": target.path, "sha256": target.content_hash,
                       "num_layers": target.num_layers, "hidden_size": target.hidden_size,
                       "vocab_size": target.vocab_size, "dtype": cfg.target_dtype},
            "layer_id_convention": LAYER_ID_CONVENTION,
            "aux_layer_ids": layer_ids,  # the stored columns, in this order
            "draft_layer_ids": draft_layer_ids,  # the subset each draft algorithm trains on by default
            "store_dtype": cfg.store_dtype,
            "engine": {k: v for k, v in run_report.items() if k in ("engine", "version", "engines")},
            "data": {"path": str(cfg.data), "source": prepared["source"], "regenerated": prepared["regenerated"],
                     "chat_template_sha256": prepared["chat_template_sha256"],
                     "chat_template": prepared.get("chat_template")},  # the text: eval of its drafts uses it
            "samples": n, "tokens": tokens, "loss_tokens": sum(e["loss_tokens"] for e in entries),
            "bytes_per_token": {
                "on_disk": sum(e["bytes"] for e in entries) / tokens,
                # hidden states (L*H + H) in the store dtype (+ float8 scales), int32 id, uint8 mask, int32 argmax
                "expected": bpt,
            },
            "draft_vocab": {"file": DRAFT_VOCAB, "size": int(d2t.numel()), "coverage": coverage(counts, t2d)},
            "shards": entries,
        }
        write_run_files(out, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash,
                                            "seed": cfg.seed, "world_size": state.num_processes}, argv, stage="capture")
        atomic_write_json(out / MANIFEST, manifest)  # last: its presence marks the capture complete
    state.wait_for_everyone()
    manifest = json.loads((out / MANIFEST).read_text())
    seconds = run_report.get("capture_s", elapsed)  # vLLM: without its engine start
    manifest["run"] = {"already_complete": done, "tokens_this_process": tokens_done, "seconds": elapsed,
                       "tokens_per_s": tokens_done / seconds if seconds > 0 else 0.0,
                       **({"engine_start_s": run_report["engine_start_s"]} if "engine_start_s" in run_report else {})}
    if state.is_main_process and tokens_done and not done:
        record_speed(target.content_hash, cfg, tokens_done * workers / seconds if seconds > 0 else 0.0)
    return manifest


def vocab_bytes(vocab_size: int) -> int:
    """draft_vocab.safetensors at most (d2t int64 [<=V], t2d bool [V], counts int64 [V]) and the json files."""
    return vocab_size * 17 + (1 << 16)


def disk_free(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(out: Path, need: float) -> None:
    free = disk_free(out)
    if need > free:
        raise DataError(f"capture into '{out}' needs {need / 2**30:.2f} GiB, but its filesystem has "
                        f"{free / 2**30:.2f} GiB free; free space, capture fewer samples (max_samples), store "
                        "float8_e4m3 (half of bfloat16), or choose another output_dir")


SPEED = "capture_speed.json"  # in the cache: the last measured tokens/s per target, engine and dtype


def _speed_key(target_sha256: str, cfg: CaptureConfig) -> str:
    return f"{target_sha256}|{cfg.engine}|{cfg.target_dtype}"


def record_speed(target_sha256: str, cfg: CaptureConfig, tokens_per_s: float) -> None:
    from trainer.target import cache_root

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


def estimate(cfg: CaptureConfig, out: Path, ds) -> dict:
    """What the capture will cost, before anything runs: bytes per token and on disk for these
    samples and layers, the time at the last tokens/s measured for this target, engine and dtype
    on this machine, and whether it fits on the output's filesystem. Loads the target's config only."""
    from transformers import AutoConfig

    from trainer.target import cache_root, content_hash, resolve_target, target_hf_dir

    source = resolve_target(cfg.target)
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
        f"{e['bytes'] / 2**30:.3f} GiB; the output's filesystem has {e['free_bytes'] / 2**30:.2f} GiB free: "
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
    if run.get("already_complete"):
        lines.append("  (already complete: nothing to do)")
    elif run:
        lines.append(f"  throughput {run['tokens_per_s']:,.0f} tokens/s (this process)")
    return "\n".join(lines)


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

"""Benchmark: training without a capture. The same SmolLM2 samples (>= 60k tokens) and the same
EAGLE-3 steps three ways: capture-then-train (a bfloat16 capture on disk, then the recipe), and
online with the target in the trainer's process (online.engine=hf) and served by vLLM in its own
process (online.engine=vllm, through Ray), both rounding to bfloat16 as the capture does; and
(--only ray) the hf target in a Ray actor beside the trainer (online.producer_resources), which
reports the balance: the producer's tokens/s, the trainer's tokens/s while it is not waiting, and
their ratio (how many trainer ranks one producer feeds for this target and draft).

    .venv/bin/python scripts/bench_online.py --out runs/bench-online [--tokens 60000] [--only hf,vllm,ray]

Each run is a subprocess (the recipes' own command lines); measured in this run, side by side:
wall time, the peak of the training data the run holds on disk (the capture folder; online, the
run's `.online/` folder: the producer's staged states, what a rank buffers, the epoch cache;
sampled every 0.2 s; the trained draft itself, the same in every run, not counted), the peak
resident memory of its process tree (sampled likewise: the trainer, vLLM's producer and Ray's
processes included), the tokens trained per second of wall time, and the final loss. Threads:
capture and train 2 each (one at a time); online vllm, trainer and producer 1 each (side by side
on the two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs" / "smollm2-135m"
PY = sys.executable


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def disk_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def measured(cmd: list[str], watch: Path, env: dict) -> dict:
    """Run `cmd`, sampling its process tree's memory and `watch`'s bytes on disk."""
    peak = {"rss": 0, "disk": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["rss"] = max(peak["rss"], tree_rss(proc.pid))
            peak["disk"] = max(peak["disk"], disk_bytes(watch) if watch.exists() else 0)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak["rss"], "peak_disk": peak["disk"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=60_000, help="at least this many training tokens")
    ap.add_argument("--only", default="capture,hf,vllm", help="of capture, hf, vllm, ray")
    ap.add_argument("--buffer-tokens", type=int, default=8192)
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    prepared = out / "prepared"
    if not (prepared / "summary.json").is_file():
        subprocess.run([PY, "-m", "recipes.cli", "prepare", "--config", str(CONFIGS / "prepare.yaml"),
                        "max_records=400", "max_length=1024", f"output_dir={prepared}", "num_proc=1"], check=True,
                       cwd=REPO)
    from trainer.data.prepared import load_prepared

    ds, _ = load_prepared(prepared)
    lengths = list(ds["length"])
    n = next((k + 1 for k in range(len(lengths)) if sum(lengths[:k + 1]) >= args.tokens), len(lengths))
    tokens = sum(lengths[:n])
    print(f"{n} samples, {tokens:,} tokens (of {len(lengths)} prepared)")
    train = ["--config", str(CONFIGS / "eagle3.yaml"), "epochs=1", "batch_size=1", "gradient_accumulation_steps=1",
             "max_length=1024", "log_every=20", "save_every=100000", f"max_samples={n}"]
    results = {}
    runs = [r for r in ("capture", "hf", "vllm", "ray") if r in args.only.split(",")]
    for name in runs:
        run = out / name
        if (run / "result.json").is_file():
            results[name] = json.loads((run / "result.json").read_text())
            continue
        run.mkdir(parents=True, exist_ok=True)
        if name == "capture":
            two = {"OMP_NUM_THREADS": "2"}
            cap = measured([PY, str(REPO / "recipes" / "capture.py"), "--config", str(CONFIGS / "capture.yaml"),
                            f"data={prepared}", f"output_dir={run / 'capture'}", f"max_samples={n}",
                            "drafts=[eagle3]", "overwrite=true"], run / "capture", two)
            tr = measured([PY, str(REPO / "recipes" / "train.py"), *train, f"data={run / 'capture'}",
                           f"output_dir={run / 'draft'}", "overwrite=true"], run / "capture", two)
            r = {"seconds": cap["seconds"] + tr["seconds"], "capture_s": cap["seconds"], "train_s": tr["seconds"],
                 "peak_disk": max(cap["peak_disk"], tr["peak_disk"]), "peak_rss": max(cap["peak_rss"], tr["peak_rss"])}
        else:
            env = {"OMP_NUM_THREADS": "2" if name == "hf" else "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
            # ray: the hf target in a Ray actor (one CPU of a local cluster), the trainer beside it
            placed = ["online.producer_resources={CPU: 1}"] if name == "ray" else []
            r = measured([PY, str(REPO / "recipes" / "train.py"), *train, f"data={prepared}", *placed,
                          f"output_dir={run / 'draft'}", f"online.engine={'hf' if name == 'ray' else name}",
                          "online.store_dtype=bfloat16",
                          "online.draft_vocab_size=8192", f"online.buffer_tokens={args.buffer_tokens}",
                          "overwrite=true"], run / "draft" / ".online", env)
        report = json.loads((run / "draft" / "train_report.json").read_text())
        r.update(tokens=report["tokens"], tokens_per_s=report["tokens"] / r["seconds"], loss=report["final"]["loss"],
                 online=report["final"].get("online"))
        line = r["online"] or {}
        if name in ("vllm", "ray") and line:  # the balance: each side's rate while it works, and their ratio
            busy = report["seconds"] - line.get("trainer_wait_s", 0.0)
            r.update(producer_tokens_per_s=line["producer_tokens_per_s"],
                     trainer_tokens_per_s=report["tokens"] / busy if busy > 0 else float("nan"))
            r["ranks_per_producer"] = r["producer_tokens_per_s"] / r["trainer_tokens_per_s"]
        (run / "result.json").write_text(json.dumps(r, indent=1))
        results[name] = r
    base = results.get("capture")
    print(f"\n{'run':<26}{'wall s':>9}{'x':>7}{'peak disk MB':>14}{'peak RSS MB':>13}{'tok/s':>8}{'final loss':>12}")
    for name, r in results.items():
        label = {"capture": "capture-then-train", "hf": "online, hf (in process)", "vllm": "online, vllm (Ray)",
                 "ray": "online, hf (Ray actor)"}[name]
        ratio = r["seconds"] / base["seconds"] if base else float("nan")
        print(f"{label:<26}{r['seconds']:>9.1f}{ratio:>7.2f}{r['peak_disk'] / 1e6:>14.1f}{r['peak_rss'] / 1e6:>13.0f}"
              f"{r['tokens_per_s']:>8.0f}{r['loss']:>12.4f}")
    for name, r in results.items():
        if "ranks_per_producer" in r:
            line = r["online"]
            print(f"{name}: producer {r['producer_tokens_per_s']:.0f} tok/s, trainer {r['trainer_tokens_per_s']:.0f} "
                  f"tok/s while not waiting: one producer feeds {r['ranks_per_producer']:.2f} trainer ranks; the "
                  f"trainer waited {line.get('trainer_wait_s', 0):.1f} s, the producer "
                  f"{line.get('producer_blocked_s', 0):.1f} s ({line['bound']})")
    if base:
        for name in ("hf", "vllm", "ray"):
            if name in results:
                print(f"{name}: peak disk {base['peak_disk'] / max(results[name]['peak_disk'], 1):.0f}x below the "
                      f"capture's; wall {results[name]['seconds'] / base['seconds']:.2f}x capture-then-train")


if __name__ == "__main__":
    main()

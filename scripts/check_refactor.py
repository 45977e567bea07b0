"""Refactors change no result: the same capture trained by each algorithm's SmolLM2 recipe with
the code of two trees, compared loss for loss and export sha256 for export sha256.

    git worktree add /tmp/before <commit>            (or `git archive <commit> | tar -x -C /tmp/before`)
    .venv/bin/python scripts/check_refactor.py --before /tmp/before --after . --out runs/refactor

One prepared set (60 ShareGPT records, max_length 1024) and one capture (its first 8 samples, the
recipe's layers and draft vocabulary) are made by the `--before` tree; each tree then trains EAGLE-3,
DFlash and DSpark on that capture with its own code (16 steps x batch 1 over two epochs, the loss
logged every 2 steps) and exports each draft BF16. Every stage runs as `python -m ...` with
PYTHONPATH set to the tree, so each tree runs its own modules. Prints the losses and sha256 side by side; exits 1 on any
difference. The capture is also made by the `--after` tree and its shards compared by sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ALGORITHMS = ("eagle3", "dflash", "dspark")
TRAIN = ["max_steps=16", "batch_size=1", "gradient_accumulation_steps=1", "log_every=2", "save_every=1000",
         "max_length=1024", "epochs=2"]


def run(tree: Path, args: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, *args], cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed in {tree} (exit {r.returncode}); log {log}")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_command(tree: Path) -> list[str]:
    """How the tree's CLI is reached (`recipes.cli` in every tree; its `export` command)."""
    return ["-m", "recipes.cli", "export"]


def capture(tree: Path, out: Path) -> Path:
    configs = tree / "recipes" / "configs" / "smollm2-135m"
    prepared, cap = out / "prepared", out / "capture"
    if not (prepared / "summary.json").is_file():
        run(tree, ["-m", "recipes.cli", "prepare", "--config", str(configs / "prepare.yaml"), "max_records=60",
                   "max_length=1024", f"output_dir={prepared}", "num_proc=1"], out / "prepare.log")
    if not (cap / "manifest.json").is_file():
        run(tree, ["-m", "recipes.cli", "capture", "--config", str(configs / "capture.yaml"), f"data={prepared}",
                   f"output_dir={cap}", "max_samples=8"], out / "capture.log")
    return cap


def train_and_export(tree: Path, cap: Path, out: Path) -> dict:
    configs = tree / "recipes" / "configs" / "smollm2-135m"
    results = {}
    for algorithm in ALGORITHMS:
        draft, export = out / algorithm, out / f"{algorithm}-bf16"
        if not (draft / "train_report.json").is_file():
            run(tree, ["-m", "recipes.train", "--config", str(configs / f"{algorithm}.yaml"), f"data={cap}",
                       f"output_dir={draft}", *TRAIN], out / f"{algorithm}-train.log")
        if not (export / "model.safetensors").is_file():
            run(tree, [*export_command(tree), "--draft", str(draft), "--output-dir", str(export)],
                out / f"{algorithm}-export.log")
        report = json.loads((draft / "train_report.json").read_text())
        results[algorithm] = {"loss": [h["loss"] for h in report["history"]],
                              "steps": [h["step"] for h in report["history"]],
                              "export_sha256": sha256(export / "model.safetensors"),
                              "config_sha256": sha256(export / "config.json"),
                              "weights_sha256": sha256(draft / "model.safetensors")}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    out = args.out.resolve()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name in trees:
        (out / name).mkdir(parents=True, exist_ok=True)
    cap = capture(trees["before"], out / "before")
    cap_after = capture(trees["after"], out / "after")
    same = True
    shards = sorted(p.name for p in cap.glob("shard-*.safetensors"))
    for s in shards:
        equal = sha256(cap / s) == sha256(cap_after / s)
        same &= equal
        print(f"capture {s}: {'equal' if equal else 'DIFFERENT'} sha256 ({sha256(cap / s)[:16]})")
    results = {name: train_and_export(tree, cap, out / name) for name, tree in trees.items()}
    for algorithm in ALGORITHMS:
        a, b = results["before"][algorithm], results["after"][algorithm]
        print(f"{algorithm}: steps {a['steps']}")
        print(f"  loss before {' '.join(f'{x:.6f}' for x in a['loss'])}")
        print(f"  loss after  {' '.join(f'{x:.6f}' for x in b['loss'])}")
        for key in ("export_sha256", "config_sha256", "weights_sha256"):
            equal = a[key] == b[key]
            same &= equal
            print(f"  {key}: {'equal' if equal else 'DIFFERENT'} ({a[key][:16]} / {b[key][:16]})")
        same &= a["loss"] == b["loss"]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("no result changed" if same else "RESULTS DIFFER")
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()

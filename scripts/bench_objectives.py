"""Benchmark: which objective and optimizer make a draft accept the most per training token (issue
41's screen; EAGLE-3 by default, DFlash or DSpark with --algorithm). Every (draft.loss, optimizer)
pair trains on the same first samples of one ShareGPT capture of SmolLM2-135M-Instruct and is
measured the same way; the table is τ per dataset with its spread, and the teacher-forced
acceptance α the training reported.

    .venv/bin/python scripts/bench_objectives.py --out runs/objectives [--records 300] [--budget 50000]
        [--algorithm eagle3|dflash|dspark] [--capture DIR]
        [--losses fkl,tv,lk,lk_hybrid,jsd,rkl] [--optimizers adamw,muon] [--cells fkl-adamw,lk_hybrid-muon@0.002]
        [--prompts 24] [--group 4] [--max-new-tokens 64]

1. Data: --records packaged ShareGPT records as written, max_length 1024, captured once (transformers
   engine, bfloat16 states, the algorithm's layers, an 8,192-token draft vocabulary), or --capture,
   an existing capture holding the algorithm's layers (bench_quality.py's holds EAGLE-3's and DFlash's).
2. Train: the recipe's draft (recipes/configs/smollm2-135m/{algorithm}.yaml; EAGLE-3: frozen target
   head rows, 3 TTT steps) at a learning rate of 5e-4 unless the cell names one, one epoch over the
   first samples reaching --budget tokens, batch 1; each pair differs only in draft.loss and optimizer
   (Muon: torch's, muon_lr = the cell's learning rate, AdamW on the rest; trainer/optim.py).
3. Measure: the in-tree decoder (it counts what vLLM counts: tests/test_vllm.py), greedy, at the
   positions the draft trained (EAGLE-3: N = 3; DFlash: block - 1; DSpark: its block),
   --prompts GSM8K and --prompts MT-Bench prompts x --max-new-tokens each, decoded --group prompts
   at a time (batched; the counts are the decoder's either way). The spread is the standard error of
   τ over those groups (each group's accepted tokens per round), so two cells whose difference is
   below about two standard errors are not told apart.
A cell is LOSS-OPTIMIZER, or LOSS-OPTIMIZER@RATE for another learning rate than the recipe's.
Every step is skipped when its output exists: a stopped run continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_quality import budget_samples, run  # noqa: E402 (the scripts folder, put on the path above)

DATASETS = ("gsm8k", "mtbench")
PY = str(REPO / ".venv" / "bin" / "python")


def capture(out: Path, records: int, algorithm: str = "eagle3") -> Path:
    prepared = out / "prepared"
    cap = out / ("capture" if algorithm == "eagle3" else f"capture-{algorithm}")
    if not (prepared / "summary.json").is_file():
        run([PY, "recipes/prepare.py", f"output_dir={prepared}", "source=sharegpt", f"max_records={records}",
             "max_length=1024"], "prepare")
    if not (cap / "manifest.json").is_file():
        run([PY, "recipes/capture.py", f"data={prepared}", f"output_dir={cap}", f"drafts=[{algorithm}]",
             "draft_vocab_size=8192", "store_dtype=bfloat16"], "capture")
    return cap


SCREEN_RATE = "0.0005"  # the learning rate of a cell without one: the SmolLM2 recipe's before Muon (issue 41)


def train(cap: Path, out: Path, n: int, loss: str, optimizer: str, lr: str | None = None,
          algorithm: str = "eagle3") -> dict:
    if not (out / "train_report.json").is_file():
        run([PY, "recipes/train.py", "--config", f"recipes/configs/smollm2-135m/{algorithm}.yaml", f"data={cap}",
             f"output_dir={out}", f"max_samples={n}", "epochs=1", "batch_size=1", "gradient_accumulation_steps=1",
             "max_length=1024", "save_every=100000", "log_every=10", "warmup_steps=10",
             *(["draft.ttt_steps=3"] if algorithm == "eagle3" else []),
             f"draft.loss={loss}", f"optimizer={optimizer}", f"learning_rate={lr or SCREEN_RATE}"]
            # a training stopped before its report is started again (the benchmark owns its folder)
            + (["overwrite=true"] if out.exists() else []), f"train {out.name}")
    return json.loads((out / "train_report.json").read_text())


def measure(draft: Path, out: Path, prompts: dict, max_new: int, group: int = 1) -> dict:
    """τ per dataset (greedy, in-tree, N = the positions the draft trained) and its standard error over
    groups of `group` prompts."""
    from export.load import load_proposer
    from trainer.speculative import measure as decode
    from trainer.target import load_target

    if out.is_file():
        return json.loads(out.read_text())
    target = load_target("smollm2-135m-instruct")
    proposer, _ = load_proposer(str(draft), target)
    n = proposer.num_positions  # EAGLE-3 at 3 TTT steps: 3
    res = {}
    for ds, batch in prompts.items():
        per = []
        for i in range(0, len(batch), group):  # a group at a time: its own τ, for the spread
            s = decode(target, proposer, batch[i:i + group], max_new, n, eos_token_ids=target.eos_token_ids,
                       batch_size=group)
            per.append((s.counts()["num_drafts"], s.counts()["num_accepted_tokens"]))
        drafts, accepted = sum(d for d, _ in per), sum(a for _, a in per)
        taus = [1 + a / d for d, a in per if d]
        mean = sum(taus) / len(taus)
        se = math.sqrt(sum((t - mean) ** 2 for t in taus) / max(len(taus) - 1, 1) / len(taus))
        res[ds] = {"tau": 1 + accepted / max(drafts, 1), "se": se, "rounds": drafts, "groups": len(taus),
                   "group": group, "num_draft_tokens": n}
    out.write_text(json.dumps(res))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/objectives")
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--budget", type=int, default=50000)
    ap.add_argument("--algorithm", default="eagle3", choices=("eagle3", "dflash", "dspark"))
    ap.add_argument("--capture", help="an existing capture holding the algorithm's layers (else one is made)")
    ap.add_argument("--losses", default="fkl,tv,lk,lk_hybrid,jsd,rkl")
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--cells", action="append", default=[],
                    help="LOSS-OPTIMIZER[@RATE] cells in this order, comma-separated (repeatable), instead of the grid")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--group", type=int, default=1, help="prompts decoded together (the spread is over groups)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from trainer.data.evalsets import chat_prompt_ids, load_prompts
    from trainer.target import load_target

    cap = Path(args.capture) if args.capture else capture(out, args.records, args.algorithm)
    if not (cap / "manifest.json").is_file():
        raise SystemExit(f"--capture {cap}: no capture there (no manifest.json); give a capture folder")
    n, tokens = budget_samples(cap, args.budget)
    tok = load_target("smollm2-135m-instruct", head_only=True).tokenizer
    prompts = {ds: chat_prompt_ids(tok, load_prompts(ds, args.prompts)) for ds in DATASETS}
    cells = ([c for group in args.cells for c in group.split(",")] if args.cells else
             [f"{loss}-{opt}" for opt in args.optimizers.split(",") for loss in args.losses.split(",")])
    rows = []
    for cell in cells:
        pair, _, lr = cell.partition("@")  # LOSS-OPTIMIZER[@LEARNING_RATE]: SCREEN_RATE unless given
        loss, optimizer = pair.rsplit("-", 1)
        d = out / (cell if args.algorithm == "eagle3" else f"{args.algorithm}.{cell}")
        report = train(cap, d, n, loss, optimizer, lr or None, args.algorithm)
        tau = measure(d, d / "tau.json", prompts, args.max_new_tokens, args.group)
        alpha = report["final"].get("alpha")
        rows.append({"loss": loss, "optimizer": optimizer, "learning_rate": lr or SCREEN_RATE, "tau": tau,
                     "alpha": alpha, "final_loss": report["final"].get("loss"), "seconds": report["seconds"]})
        print(json.dumps({"cell": cell, **{ds: round(tau[ds]["tau"], 3) for ds in DATASETS},
                          "alpha": [round(a, 3) for a in alpha or []]}), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    trained = rows[0]["tau"][DATASETS[0]].get("num_draft_tokens", 3) if rows else 3
    print(f"\n{args.algorithm} on SmolLM2-135M-Instruct, {tokens:,} training tokens ({n} ShareGPT samples, one epoch, "
          f"batch 1); τ at N = {trained}, greedy, in-tree, {args.prompts} prompts x {args.max_new_tokens} tokens "
          f"per dataset (± one standard error over groups of {args.group}); "
          "α: the last logged teacher-forced acceptance per step")
    print(f"{'loss':<11}{'optimizer':<10}{'lr':<8}" + "".join(f"{ds:>16}" for ds in DATASETS) + "   α per position")
    for r in rows:
        print(f"{r['loss']:<11}{r['optimizer']:<10}{r['learning_rate']:<8}"
              + "".join(f"{r['tau'][ds]['tau']:>9.3f} ±{r['tau'][ds]['se']:.3f}" for ds in DATASETS)
              + "   " + " ".join(f"{a:.3f}" for a in r["alpha"] or []))


if __name__ == "__main__":
    main()

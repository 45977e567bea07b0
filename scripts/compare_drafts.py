"""Benchmark: EAGLE-3 vs DFlash vs DSpark on one capture with the same token budget (DSpark
also without its Markov head), and DFlash FP8 with q/k/v in FP8 vs BF16.

    .venv/bin/python scripts/compare_drafts.py --capture runs/cmp/capture --out runs/cmp [--steps 100]

The capture must hold the drafts' layers (`draftsmith capture ... drafts=[eagle3,dflash,dspark]`).
1. Trains an EAGLE-3 (recipes/configs/smollm2-135m/eagle3.yaml), a DFlash (.../dflash.yaml)
   and a DSpark draft (.../dspark.yaml) for the same optimizer steps, batch and max_length
   on the same samples in the same order: the same tokens (the table states how many).
2. Evaluates them in-tree (greedy, lossless) on GSM8K and MT-Bench at N = 3 and 7: τ,
   conditional acceptance per position, DSpark's backbone without its Markov head (the
   ablation), and the ratios DFlash/EAGLE-3 and DSpark/DFlash of τ.
3. Exports the DFlash draft FP8 twice (Quark ptpc_fp8): q/k/v FP8 and q/k/v BF16, and
   prints each FP8 gate (τ FP8 vs BF16, in-tree with FP8 simulated as vLLM computes it).
The baseline of every ratio is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from export.load import load_proposer
from recipes import export_draft as export_recipe
from recipes import train
from trainer.config import ExportConfig, TrainConfig, load_config
from trainer.data.evalsets import chat_prompt_ids, load_prompts
from trainer.speculative import measure
from trainer.target import load_target

CONFIGS = {"eagle3": "recipes/configs/smollm2-135m/eagle3.yaml", "dflash": "recipes/configs/smollm2-135m/dflash.yaml",
           "dspark": "recipes/configs/smollm2-135m/dspark.yaml"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", default="runs/cmp/capture")
    ap.add_argument("--out", default="runs/cmp")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--skip-train", action="store_true", help="reuse the drafts in --out")
    ap.add_argument("--drafts", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    ap.add_argument("--no-fp8", action="store_true", help="skip the DFlash FP8 q/k/v comparison")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ALGO:KEY=VALUE[,KEY=VALUE]",
                    help="one more draft, trained and evaluated like the rest, with its ratio to ALGO "
                         "(e.g. eagle3-frozen-head=eagle3:draft.train_lm_head=false); repeatable")
    args = ap.parse_args()
    variants = {name: (CONFIGS[name], []) for name in args.drafts.split(",") if name}  # name -> (config, overrides)
    against = {}  # variant -> the algorithm its τ is compared with
    for v in args.variant:
        name, _, spec = v.partition("=")
        against[name], _, overrides = spec.partition(":")
        variants[name] = (CONFIGS[against[name]], [o for o in overrides.split(",") if o])
    drafts = list(variants)
    out = Path(args.out)
    common = [f"data={args.capture}", f"max_steps={args.steps}", "epochs=100", "batch_size=1",
              "gradient_accumulation_steps=1", f"max_length={args.max_length}", "save_every=100000",
              "log_every=25", "overwrite=true"]
    reports = {}
    for name, (path, overrides) in variants.items():
        if args.skip_train:
            reports[name] = json.loads((out / name / "train_report.json").read_text())
            continue
        t0 = time.perf_counter()
        reports[name] = train.run(load_config(TrainConfig, path, [*common, *overrides, f"output_dir={out / name}"]))
        print(f"{name}: {train.format_report(reports[name])} ({time.perf_counter() - t0:.0f} s)")

    target = load_target("smollm2-135m-instruct")
    rows = []
    for dataset in ("gsm8k", "mtbench"):
        prompts = chat_prompt_ids(target.tokenizer, load_prompts(dataset, args.prompts))
        for n in (3, 7):
            taus = {}
            runs = [(name, {}) for name in drafts] + ([("dspark", {"markov": False})] if "dspark" in drafts else [])
            for name, options in runs:
                label = name + (" no-Markov" if options else "")
                draft, _ = load_proposer(str(out / name), target, **options)
                s = measure(target, draft, prompts, args.max_new_tokens, n, eos_token_ids=target.eos_token_ids)
                taus[label] = s.tau
                rows.append((dataset, n, label, s.tau, s.conditional_acceptance))
            for a, b in (("dflash", "eagle3"), ("dspark", "dflash"), ("dspark", "dspark no-Markov"), *against.items()):
                if a in taus and b in taus:
                    rows.append((dataset, n, f"{a}/{b}", taus[a] / taus[b], []))

    print(f"\nSmolLM2-135M-Instruct, one capture ({args.capture}); each draft trained {args.steps} steps x batch 1 "
          f"(max_length {args.max_length}, the same samples in the same order); in-tree greedy eval, "
          f"{args.prompts} prompts x {args.max_new_tokens} new tokens; {torch.get_num_threads()} threads")
    for name, r in reports.items():
        f = r["final"]
        print(f"  {name}: {r['steps']} steps, {r.get('tokens', 0):,.0f} tokens, "
              f"simulated τ {f.get('tau', float('nan')):.2f}, "
              f"{f.get('tokens_per_s', 0):.0f} training tokens/s")
    print(f"{'dataset':<9}{'N':>3}  {'draft':<26}{'τ':>7}   conditional acceptance per position")
    for dataset, n, name, tau, acc in rows:
        print(f"{dataset:<9}{n:>3}  {name:<26}{tau:>7.3f}   " + " ".join(f"{a:.2f}" for a in acc))
    if args.no_fp8 or "dflash" not in drafts:
        return

    print("\nDFlash FP8 (Quark ptpc_fp8, fc BF16): q/k/v FP8 vs q/k/v BF16, gate on mtbench, N=3")
    for quantize_qkv in (True, False):
        m = export_recipe.run(ExportConfig(draft=str(out / "dflash"),
                                           output_dir=str(out / f"dflash-fp8-qkv{int(quantize_qkv)}"),
                                           quantize="fp8", quantize_qkv=quantize_qkv, num_draft_tokens=3,
                                           gate_prompts=args.prompts, max_tau_drop=0.99, overwrite=True))
        g = m["gate"]
        print(f"  q/k/v {'FP8 ' if quantize_qkv else 'BF16'}: τ {g['tau_fp8']:.3f} vs BF16 draft {g['tau_bf16']:.3f} "
              f"({g['relative_change']:+.1%}), weights {m['size']['fp8_bytes'] / 1e6:.1f} MB vs "
              f"{m['size']['bf16_bytes'] / 1e6:.1f} MB BF16")


if __name__ == "__main__":
    main()

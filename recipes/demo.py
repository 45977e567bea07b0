"""The demo: the whole pipeline on the embedded target (SmolLM2-135M-Instruct) in about
15 minutes on 2 CPU cores: prepare a ShareGPT slice -> capture hidden states -> train a
draft (`algorithm=`, EAGLE-3 by default) -> export it BF16 and FP8 (AMD Quark) -> evaluate
both with the in-tree decoder -> a table and the `vllm serve` command for the result.

    make demo                      (sets up .venv, then runs this)
    python -m recipes.demo --config recipes/configs/smollm2-135m/demo.yaml [key=value ...]
    draftsmith demo [key=value ...]  (the same config: it is the default)

An earlier demo's output_dir is never replaced unless overwrite=true is given.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from export.formats import exporter
from recipes import capture, prepare, train
from recipes import eval as eval_recipe
from recipes import export_draft as export_recipe
from recipes._common import one_line_errors, parse_args
from trainer.config import DemoConfig, EvalConfig, ExportConfig
from trainer.data.chat import template_file
from trainer.data.evalsets import dataset_file
from trainer.data.sources import resolve_source, source_entries
from trainer.drafts.registry import get
from trainer.errors import DraftsmithError
from trainer.io import claim_output, ensure_dir, guard_output
from trainer.target import resolve_target


def stage_configs(cfg: DemoConfig, out: Path) -> tuple[dict, dict[str, ExportConfig]]:
    """The demo's stage configs, assembled from its sections (each stage gets the demo's target,
    algorithm and paths under `out`; the draft section is the algorithm's from
    `draft_by_algorithm`, with `train.draft.*` on top) and checked as each stage checks its
    own, before any work. Returns ({prepare, capture, train}, {bf16, fp8} export configs)."""
    p, c, t = cfg.prepare, cfg.capture, cfg.train
    p.target = c.target = t.target = cfg.target
    p.output_dir = str(out / "prepared")
    c.data, c.output_dir = p.output_dir, str(out / "capture")
    t.data, t.output_dir, t.algorithm = c.output_dir, str(out / cfg.algorithm), cfg.algorithm
    given = dataclasses.asdict(t.draft) if dataclasses.is_dataclass(t.draft) else t.draft
    t.draft = {**cfg.draft_by_algorithm.get(cfg.algorithm, {}), **given}  # train.draft.* wins
    if cfg.algorithm not in c.drafts:
        c.drafts = [*c.drafts, cfg.algorithm]
    p.overwrite = c.overwrite = t.overwrite = cfg.overwrite or p.overwrite
    for section in (p, c, t):
        section.validate()
    n = cfg.num_draft_tokens
    exports = {"bf16": ExportConfig(draft=t.output_dir, output_dir=str(out / "export-bf16"), target=cfg.target,
                                    num_draft_tokens=n, overwrite=cfg.overwrite),
               "fp8": ExportConfig(draft=t.output_dir, output_dir=str(out / "export-fp8"), target=cfg.target,
                                   num_draft_tokens=n, quantize="fp8", quantize_fc=cfg.quantize_fc,
                                   gate_dataset=cfg.eval_dataset, gate_prompts=cfg.gate_prompts,
                                   gate_max_new_tokens=cfg.eval_max_new_tokens, overwrite=cfg.overwrite)}
    return {"prepare": p, "capture": c, "train": t}, exports


def run(cfg: DemoConfig, argv: list[str] | None = None) -> dict:
    # check, before any work: the output folder, and every stage's config
    sources = [resolve_source(name) for name, _ in source_entries(cfg.prepare.source)]
    inputs = [resolve_target(cfg.target).path, *sources, dataset_file(cfg.eval_dataset),
              template_file(cfg.prepare.chat_template)]
    out = guard_output(cfg.output_dir, inputs, "demo", cfg.overwrite)
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise DraftsmithError(f"demo output_dir '{out}' holds an earlier run; pass overwrite=true to replace it "
                              "(make demo ARGS=overwrite=true) or output_dir=another/folder")
    stages, exports = stage_configs(cfg, out)
    claim_output(ensure_dir(out), "demo")  # only a folder the demo marked is ever replaced by a demo

    t0 = time.perf_counter()
    p, c, t = stages["prepare"], stages["capture"], stages["train"]
    print(f"[1/6] prepare: {p.max_records} records of '{p.source}' -> {p.output_dir}")
    prepared = prepare.run(p, argv)
    print(prepare.format_summary(prepared))

    print(f"[2/6] capture: {cfg.target} -> {c.output_dir}")
    manifest = capture.run(c, argv)
    print(capture.format_summary(manifest))

    print(f"[3/6] train {cfg.algorithm}: {t.max_steps} steps -> {t.output_dir}")
    trained = train.run(t, argv)
    print(train.format_report(trained))

    results = {}
    for step, (name, ecfg) in enumerate(exports.items(), start=4):
        print(f"[{step}/6] export {name.upper()} -> {ecfg.output_dir}")
        results[name] = {"export": export_recipe.run(ecfg, argv)}
        print(export_recipe.format_summary(results[name]["export"]))

    n = results["bf16"]["export"]["num_draft_tokens"]  # as given, or the positions the draft trained
    print(f"[6/6] evaluate both exports in-tree on {cfg.eval_dataset} ({cfg.eval_prompts} prompts, N={n})")
    ablations = list(get(cfg.algorithm).Proposer.ABLATIONS)  # what the algorithm's parts add, on the BF16 export
    for name, ecfg in exports.items():
        ev = EvalConfig(draft=ecfg.output_dir, target=cfg.target, dataset=cfg.eval_dataset,
                        num_prompts=cfg.eval_prompts, max_new_tokens=cfg.eval_max_new_tokens,
                        num_draft_tokens=n, output_dir=str(Path(ecfg.output_dir) / "eval"),
                        ablations=ablations if name == "bf16" else [])
        results[name]["eval"] = eval_recipe.run(ev, argv)

    print(f"\ndemo finished in {time.perf_counter() - t0:.0f} s; outputs in {out}/\n")
    print(format_table(results, trained))
    return {"prepare": prepared, "capture": manifest, "train": trained, **results}


def format_table(results: dict, trained: dict) -> str:
    n = results["bf16"]["eval"]["num_draft_tokens"]
    ev0 = results["bf16"]["eval"]
    head = (f"{'draft':<8}{'τ':>7}" + "".join(f"{'acc@' + str(k):>8}" for k in range(1, n + 1))
            + f"{'tok/s':>8}{'speedup':>9}{'best N':>8}{'weights':>11}")

    rows = [f"{exporter(trained['algorithm']).TITLE}, {trained['steps']} training steps on "
            f"{trained.get('tokens', 0):,.0f} "
            f"tokens; in-tree eval on {ev0['dataset']} ({ev0['prompts']} prompts, greedy, N={n}); acc@k = conditional "
            "acceptance at draft position k",
            head, "-" * len(head)]
    sizes = {name: r["export"]["files"]["model.safetensors"]["bytes"] for name, r in results.items()}
    for name, r in results.items():
        e = r["eval"]
        rows.append(f"{name.upper():<8}{e['tau']:>7.3f}" + "".join(f"{a:>8.3f}" for a in e["conditional_acceptance"])
                    + f"{e['speculative']['tokens_per_s']:>8.1f}{e['speedup']:>8.2f}x"
                    + f"{e['best_num_draft_tokens']['best_n']:>8}{sizes[name] / 1e6:>8.1f} MB")
    fp8, bf16 = results["fp8"], results["bf16"]
    rows.append(f"FP8 vs BF16: τ {fp8['eval']['tau'] / bf16['eval']['tau'] - 1:+.1%}, weights "
                f"{sizes['fp8'] / sizes['bf16'] - 1:+.1%} ({', '.join(fp8['export']['quantization']['keep_bf16'])} "
                "stay BF16)")
    for name, a in bf16["eval"].get("ablations", {}).items():  # the variants the algorithm declares
        rows.append(f"BF16 {name}: τ {a['tau']:.3f}, conditional acceptance "
                    + " ".join(f"{x:.3f}" for x in a["conditional_acceptance"]))
    gate = fp8["export"].get("gate")
    if gate:
        rows.append(f"FP8 gate at export: τ {gate['tau_fp8']:.3f} vs {gate['tau_bf16']:.3f} "
                    f"({gate['relative_change']:+.1%}, bound -{gate['max_tau_drop']:.0%})")
    rows.append(f"this budget ({trained.get('tokens', 0):,.0f} training tokens) on the learning curve of draftsmith's "
                "drafts (τ against training tokens, on data as written and regenerated): README, 'Learning curve' "
                "(scripts/bench_quality.py)")
    rows.append("\nserve the target with a draft (ROCm or CUDA vLLM; pick N from 'best N'):")
    for name, r in results.items():
        rows.append(f"  {name.upper()}: {r['export']['serve']}")
    served = results["bf16"]["export"].get("servable") or {}
    if served and not served["servable"]:
        rows.append(f"  warning: {served['line']}")
    return "\n".join(rows)


# `draftsmith demo` without --config runs what `make demo` runs: the packaged demo config.
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2-135m" / "demo.yaml"


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    cfg = parse_args(DemoConfig, argv, __doc__, prog="draftsmith demo")
    run(cfg, argv)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Benchmark (issue 43 item 5): the same training budget spent three ways, and τ per context length.
Does a draft trained on short samples lose acceptance on long prompts, and do long samples (with or
without a sliding window) keep it?

    .venv/bin/python scripts/bench_long_context.py --out runs/long-context [--records 3000] [--budget 200000]
        [--algorithm dflash] [--window 512] [--buckets 1024,2048,4096,8192] [--prompts 8] [--max-new-tokens 32]
        [--anchors per-token|per-sample]

1. Data: the first --records packaged ShareGPT records prepared twice, "short" (max_length 1024, the
   recipes' usual cut) and "long" (max_length 8192, SmolLM2-135M's context: a longer conversation is
   skipped, never cut), each captured once as far as the budget reads (transformers engine,
   bfloat16, the algorithm's layers, an 8,192-token draft vocabulary).
2. Train the SmolLM2 recipe's draft (recipes/configs/smollm2-135m/{algorithm}.yaml) one epoch over the
   first samples of a capture reaching --budget tokens, batch 1, three ways: short; long; long with
   draft.sliding_window=--window on every layer (DFlash and DSpark only: draftsmith's EAGLE-3 trains
   full attention, so its third way is left out). DFlash and DSpark train on `draft.num_anchors`
   blocks per sample: with --anchors per-token (the default) each way's num_anchors is scaled so that
   it trains as many blocks per answer token as the short way does at the recipe's num_anchors (a
   long sample otherwise gets as many blocks as a short one: fewer per token, a confound); with
   per-sample every way keeps the recipe's.
3. Measure: as `draftsmith eval --context-buckets` measures one draft (its prompts, proposer and
   per-bucket report: recipes/eval.py; in-tree, its counts are vLLM's, tests/test_vllm.py), greedy, at
   the draft's trained N, --prompts prompts per bucket built to that length (documents and a
   question: trainer/data/buckets.py), the same prompts for every draft; all ways in one process,
   each batch prefilled once for plain decoding and every draft (trainer.speculative.measure_together:
   at 8K the prefill is most of an eval).
The goal (issue 43): the long-trained draft's τ at 4-8K within 10% of its τ at 1K, with the
short-trained draft's drop beside it. Every step is skipped when its output exists: a stopped run
continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_quality import budget_samples, run  # noqa: E402 (the scripts folder, put on the path above)

PY = str(REPO / ".venv" / "bin" / "python")
LENGTHS = {"short": 1024, "long": 8192}


def needed(prepared: Path, budget: int) -> int:
    """The fewest first prepared samples whose tokens reach `budget`: all the training reads (the
    capture keeps the prepared order), so the capture stops there instead of taking hours on the rest."""
    from trainer.data.prepared import load_prepared

    ds = load_prepared(prepared)[0]
    tokens = 0
    for n, ids in enumerate(ds["input_ids"], 1):
        tokens += len(ids)
        if tokens >= budget:
            return n
    return len(ds)


def capture(out: Path, name: str, records: int, algorithm: str, budget: int) -> Path:
    prepared, cap = out / f"prepared-{name}", out / f"capture-{name}"
    if not (prepared / "summary.json").is_file():
        run([PY, "recipes/prepare.py", f"output_dir={prepared}", "source=sharegpt", f"max_records={records}",
             f"max_length={LENGTHS[name]}"], f"prepare {name}")
    if not (cap / "manifest.json").is_file():
        run([PY, "recipes/capture.py", f"data={prepared}", f"output_dir={cap}", f"drafts=[{algorithm}]",
             "draft_vocab_size=8192", "store_dtype=bfloat16", f"max_samples={needed(prepared, budget)}"],
            f"capture {name}")
    return cap


def anchor_positions(prepared: Path, n: int) -> list[int]:
    """Per sample, how many positions an anchor may take (the library's `anchor_eligible`, a
    sample alone: batch 1, no padding), over the first n prepared samples."""
    import torch

    from trainer.data.prepared import load_prepared
    from trainer.drafts.dflash import anchor_eligible

    counts = []
    for mask in load_prepared(prepared)[0].select(range(n))["loss_mask"]:
        m = torch.tensor([mask])
        counts.append(int(anchor_eligible(m, torch.ones_like(m)).sum()))
    return counts


def blocks_per_position(counts: list[int], num_anchors: int) -> float:
    """The blocks trained per anchor position at batch 1: each sample takes min(num_anchors, its positions)."""
    return sum(min(num_anchors, c) for c in counts) / max(sum(counts), 1)


def matching_anchors(counts: list[int], density: float) -> int:
    """The fewest num_anchors whose blocks per anchor position reach `density` on these samples."""
    lo, hi = 1, max(counts + [1])
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if blocks_per_position(counts, mid) >= density else (mid + 1, hi)
    return lo


def recipe_anchors(algorithm: str) -> int:
    from trainer.config import TrainConfig, load_config

    cfg = load_config(TrainConfig, REPO / f"recipes/configs/smollm2-135m/{algorithm}.yaml", [])
    return cfg.draft.num_anchors


def train(cap: Path, out: Path, algorithm: str, n: int, max_length: int, extra: list[str]) -> None:
    if (out / "train_report.json").is_file():
        return
    run([PY, "recipes/train.py", "--config", f"recipes/configs/smollm2-135m/{algorithm}.yaml", f"data={cap}",
         f"output_dir={out}", f"max_samples={n}", "epochs=1", "batch_size=1", "gradient_accumulation_steps=1",
         f"max_length={max_length}", "save_every=100000", "log_every=10", "warmup_steps=10", *extra]
        + (["overwrite=true"] if out.exists() else []), f"train {out.name}")


def measure(drafts: dict[str, Path], out: Path, buckets: str, prompts: int, max_new: int) -> dict[str, list]:
    """{way: eval's per-bucket reports} for every way's draft on the same bucket prompts, each batch
    prefilled once for the plain decode and every draft (the prefill's seconds charged to each)."""
    path = out / "evals.json"
    if path.is_file():
        return json.loads(path.read_text())
    from dataclasses import replace

    from recipes._common import default_num_draft_tokens, target_for
    from recipes.eval import bucket_prompts, make_draft
    from trainer.config import EvalConfig
    from trainer.io import atomic_write_json
    from trainer.metrics import bucket_report
    from trainer.speculative import Sampling, measure_together
    from trainer.target import load_target, resolve_target

    cfg = EvalConfig(draft=str(next(iter(drafts.values()))), context_buckets=[int(b) for b in buckets.split(",")],
                     num_prompts=prompts, max_new_tokens=max_new)
    target = load_target(resolve_target(target_for(cfg.draft, cfg.target)))
    sets, _ = bucket_prompts(cfg, target)
    proposers = [make_draft(replace(cfg, draft=str(d)), target)[0] for d in drafts.values()]
    n = default_num_draft_tokens(cfg.num_draft_tokens, proposers[0])
    # each bucket's reports kept as it is measured (an 8K bucket takes hours here): a stopped run
    # resumes at the first bucket not measured
    partial = out / "evals-partial.json"
    done = json.loads(partial.read_text()) if partial.is_file() else {}
    for L, some in sets.items():
        if str(L) in done:
            continue
        plain, *spec = measure_together(target, [None, *proposers], some, max_new, n,
                                        Sampling(cfg.temperature, cfg.top_p, cfg.top_k), target.eos_token_ids,
                                        cfg.batch_size, cfg.seed, progress=f"eval ({L}-token context)")
        done[str(L)] = {way: bucket_report(L, [len(p) for p in some], s, plain) for way, s in zip(drafts, spec)}
        atomic_write_json(partial, done)
    res = {way: [done[str(L)][way] for L in sets] for way in drafts}
    atomic_write_json(path, res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/long-context")
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--budget", type=int, default=200000)
    ap.add_argument("--algorithm", default="dflash", choices=("dflash", "dspark", "eagle3"))
    ap.add_argument("--window", type=int, default=512, help="the sliding window of the third way, in tokens")
    ap.add_argument("--buckets", default="1024,2048,4096,8192")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per bucket")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--anchors", default="per-token", choices=("per-token", "per-sample"),
                    help="DFlash/DSpark blocks: as many per answer token in every way (the short way's density "
                         "at the recipe's num_anchors), or the recipe's num_anchors per sample")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caps = {name: capture(out, name, args.records, args.algorithm, args.budget) for name in LENGTHS}
    ways = [("short", "short", []), ("long", "long", [])]
    if args.algorithm != "eagle3":
        ways.append((f"long-window{args.window}", "long", [f"draft.sliding_window={args.window}"]))
    trained = {}
    scaled = args.algorithm != "eagle3" and args.anchors == "per-token"
    if scaled:
        base = recipe_anchors(args.algorithm)
        short_n = budget_samples(caps["short"], args.budget, LENGTHS["short"])[0]
        density = blocks_per_position(anchor_positions(out / "prepared-short", short_n), base)
    for way, data, extra in ways:
        n, tokens = budget_samples(caps[data], args.budget, LENGTHS[data])
        anchors = None
        if scaled:
            anchors = matching_anchors(anchor_positions(out / f"prepared-{data}", n), density)
            extra = [*extra, f"draft.num_anchors={anchors}"]
        d = out / f"{args.algorithm}-{way}"
        train(caps[data], d, args.algorithm, n, LENGTHS[data], extra)
        trained[way] = (d, {"way": way, "samples": n, "tokens": tokens, "num_anchors": anchors})
    evals = measure({way: d for way, (d, _) in trained.items()}, out, args.buckets, args.prompts, args.max_new_tokens)
    rows = []
    for way, (_, row) in trained.items():
        by = {b["context"]: b for b in evals[way]}
        rows.append({**row, "tau": {L: by[L]["tau"] for L in by},
                     "rounds": {L: by[L]["counts"]["num_drafts"] for L in by},
                     "tokens_per_s": {L: [by[L]["tokens_per_s"], by[L]["plain_tokens_per_s"]] for L in by}})
        print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    buckets = sorted(rows[0]["tau"])
    print(f"\n{args.algorithm} on SmolLM2-135M-Instruct, {args.budget:,} training tokens each way "
          f"(one epoch, batch 1); τ in-tree, greedy, {args.prompts} prompts x {args.max_new_tokens} new tokens "
          f"per bucket; anchors {args.anchors}; the change at the longest bucket against the first")
    print(f"{'way':<20}{'samples':>8}{'tokens':>10}{'anchors':>8}" + "".join(f"{L:>9}" for L in buckets) + "   change")
    for r in rows:
        t = r["tau"]
        anchors = str(r.get("num_anchors") or "-")
        taus = "".join(f"{t[L]:>9.3f}" for L in buckets)
        change = (t[buckets[-1]] - t[buckets[0]]) / t[buckets[0]]
        print(f"{r['way']:<20}{r['samples']:>8}{r['tokens']:>10,}{anchors:>8}{taus}   {change:+.1%}")


if __name__ == "__main__":
    main()

"""Sampled acceptance, in-tree against vLLM: an export decoded at temperature T > 0 by the vLLM
here (trainer/vllm/runners/vllm_generate.py, the export's method and N, vLLM's draft_sample_method)
and by the in-tree decoder (the same prompts, the same draft sampling), and the acceptance rate at
each draft position compared within 3 standard errors (a pooled two-proportion test; the samples
differ, so the rates agree in distribution, not count for count). Exits 1 where they do not.

    .venv/bin/python scripts/check_sampled_acceptance.py --export runs/demo/eagle3-bf16 [--prompts 6]
        [--dataset gsm8k] [--max-new-tokens 256] [--temperature 1.0] [--draft-sampling greedy]

Needs >= 400 rounds on each side for the test to mean much (it says so). At temperature 0 the
vLLM test suite asserts the counts equal outright (tests/test_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from export.load import load_proposer
from recipes._common import target_for
from trainer.data.evalsets import chat_prompt_ids, load_prompts
from trainer.metrics import sampled_acceptance_agreement
from trainer.speculative import DecodeStats, Sampling, generate
from trainer.target import load_target
from trainer.vllm import checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--target", default=None, help="default: the one the export records")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--draft-sampling", default="greedy", choices=["greedy", "probabilistic"],
                    help="vLLM's draft_sample_method (its default: greedy), and the in-tree decoder's")
    args = ap.parse_args()
    manifest = json.loads((args.export / "draftsmith_export.json").read_text())
    target = load_target(target_for(str(args.export), args.target))
    prompts = chat_prompt_ids(target.tokenizer, load_prompts(args.dataset, args.prompts))
    n = manifest["num_draft_tokens"]
    with tempfile.TemporaryDirectory() as work:
        theirs = checks.run_vllm_jobs([{
            "target": target.hf_dir, "prompts": prompts, "out": f"{work}/vllm.json", "draft": str(args.export),
            "method": manifest["method"], "num_speculative_tokens": n, "max_new_tokens": args.max_new_tokens,
            "dtype": manifest["dtype"], "temperature": args.temperature, "seed": 0,
            "draft_sample_method": args.draft_sampling}])[0]["spec"]
    draft, name = load_proposer(str(args.export), target, draft_sampling=args.draft_sampling)
    ours = DecodeStats(n)
    for i, prompt in enumerate(prompts):
        _, s = generate(target, [prompt], args.max_new_tokens, draft, n, sampling=Sampling(args.temperature),
                        eos_token_ids=target.eos_token_ids, seed=i)
        ours.merge(s)
    print(f"{name}, {len(prompts)} {args.dataset} prompts, T={args.temperature}, draft sampling "
          f"{args.draft_sampling}, N={n}: rounds vLLM {theirs['num_drafts']}, in-tree {ours.rounds}")
    rows = sampled_acceptance_agreement((theirs["accepted_per_position"], theirs["num_drafts"]),
                                        (ours.accepted_at, ours.rounds))
    for r in rows:
        a, m1, b, m2 = r["counts"]
        print(f"  position {r['position']}: vLLM {r['theirs']:.4f} ({a}/{m1}), in-tree {r['ours']:.4f} ({b}/{m2}), "
              f"|diff| {r['diff']:.4f} vs 3 SE {r['bound']:.4f}: {'agree' if r['agree'] else 'DIFFER'}")
    agree = all(r["agree"] for r in rows)
    if min(theirs["num_drafts"], ours.rounds) < 400:
        print("  (fewer than 400 rounds on a side: a weak test; give more prompts or tokens)")
    print("agree within 3 standard errors" if agree else "DIFFER")
    raise SystemExit(0 if agree else 1)


if __name__ == "__main__":
    main()

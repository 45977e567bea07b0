"""Benchmark: what storing hidden states in float8_e4m3 (a scale per token and layer) costs
against bfloat16: bytes/token, and τ of the same drafts trained on each.

    .venv/bin/python scripts/bench_store_dtype.py --out runs/store [--records 400] [--samples 160] [--steps 300]

1. One prepared ShareGPT slice (--records, max_length 1024), captured twice by the same
   target (fp32) and the same samples: stored bfloat16 and float8_e4m3 (layers of EAGLE-3 and
   DFlash).
2. On each capture, an EAGLE-3 and a DFlash draft (recipes/configs/smollm2-135m/*.yaml) trained
   --steps steps, batch 1, on the same samples in the same order (same seed): the stored
   precision is the only difference.
3. Each draft measured in-tree (greedy, lossless; its counts are vLLM's, tests/test_vllm.py) on
   GSM8K and MT-Bench: τ at N = 3 (EAGLE-3) and 7 (DFlash), and the float8/bfloat16 ratio.
4. Bytes/token: on disk here (H=576), and by the same formula at H=4096 for EAGLE-3's 3 layers
   plus the last (a Llama-3.1-8B-sized target), against speculators' 32 KiB (bf16 states).
Each step is skipped when its output exists (rerun to continue).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from export.load import load_proposer
from recipes import capture, prepare, train
from trainer.config import CaptureConfig, PrepareConfig, TrainConfig, load_config
from trainer.data.evalsets import chat_prompt_ids, load_prompts
from trainer.data.shards import bytes_per_token
from trainer.speculative import measure
from trainer.target import load_target

REPO = Path(__file__).resolve().parent.parent
DTYPES = ("bfloat16", "float8_e4m3")
ALGORITHMS = {"eagle3": 3, "dflash": 7}  # N measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/store")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    if not (out / "prepared" / "summary.json").is_file():
        prepare.run(PrepareConfig(output_dir=str(out / "prepared"), source="sharegpt", max_records=args.records,
                                  max_length=1024))
    manifests = {}
    for dtype in DTYPES:
        manifests[dtype] = capture.run(CaptureConfig(
            data=str(out / "prepared"), output_dir=str(out / f"capture-{dtype}"), store_dtype=dtype,
            drafts=["eagle3", "dflash"], max_samples=args.samples, draft_vocab_size=8192))
    reports = {}
    for dtype in DTYPES:
        for algorithm in ALGORITHMS:
            d = out / f"{algorithm}-{dtype}"
            if not (d / "train_report.json").is_file():
                train.run(load_config(TrainConfig, REPO / f"recipes/configs/smollm2-135m/{algorithm}.yaml", [
                    f"data={out / f'capture-{dtype}'}", f"output_dir={d}", f"max_steps={args.steps}", "epochs=100",
                    "batch_size=1", "gradient_accumulation_steps=1", "save_every=100000", "log_every=25",
                    "overwrite=true"]))
            reports[(algorithm, dtype)] = json.loads((d / "train_report.json").read_text())
    target = load_target("smollm2-135m-instruct")
    taus = {}
    for dataset in ("gsm8k", "mtbench"):
        prompts = chat_prompt_ids(target.tokenizer, load_prompts(dataset, args.prompts))
        for (algorithm, dtype) in reports:
            draft, _ = load_proposer(str(out / f"{algorithm}-{dtype}"), target)
            s = measure(target, draft, prompts, args.max_new_tokens, ALGORITHMS[algorithm],
                        eos_token_ids=target.eos_token_ids)
            taus[(algorithm, dtype, dataset)] = (s.tau, s.counts())

    print(f"\nSmolLM2-135M-Instruct (H=576), {manifests['bfloat16']['samples']} ShareGPT samples "
          f"({manifests['bfloat16']['tokens']:,} tokens) captured twice; each draft {args.steps} steps x batch 1 on "
          f"the same samples in the same order; in-tree greedy eval, {args.prompts} prompts x {args.max_new_tokens} "
          f"new tokens; {torch.get_num_threads()} threads")
    print(f"{'store dtype':<13}{'bytes/token here':>17}{'at H=4096 (EAGLE-3)':>21}   "
          + "   ".join(f"{a} {ds} N={ALGORITHMS[a]}" for a in ALGORITHMS for ds in ("gsm8k", "mtbench")))
    for dtype in DTYPES:
        bpt = manifests[dtype]["bytes_per_token"]["on_disk"]
        big = bytes_per_token(3, 4096, dtype)
        print(f"{dtype:<13}{bpt:>17,.1f}{big:>14,.0f} B ({big / 1024:.2f} KiB)   "
              + "   ".join(f"{taus[(a, dtype, ds)][0]:>{len(f'{a} {ds} N=7')}.3f}" for a in ALGORITHMS
                         for ds in ("gsm8k", "mtbench")))
    ratio = "   ".join(f"{a} {ds}: {taus[(a, 'float8_e4m3', ds)][0] / taus[(a, 'bfloat16', ds)][0] - 1:+.2%}"
                       for a in ALGORITHMS for ds in ("gsm8k", "mtbench"))
    print(f"float8/bfloat16 τ: {ratio}")
    b16, f8 = (manifests[d]["bytes_per_token"]["on_disk"] for d in DTYPES)
    print(f"float8/bfloat16 bytes/token on disk: {f8 / b16:.3f}; speculators stores bf16 states (32 KiB/token at "
          f"H=4096 for EAGLE-3's 4 states): float8 here is {bytes_per_token(3, 4096, 'float8_e4m3') / 32768:.3f} of it")
    (out / "results.json").write_text(json.dumps({
        "bytes_per_token": {d: manifests[d]["bytes_per_token"] for d in DTYPES},
        "tau": {f"{a}/{d}/{ds}": {"tau": t, "counts": c} for (a, d, ds), (t, c) in taus.items()},
        "train": {f"{a}/{d}": {"tokens": r.get("tokens"), "final": r["final"]} for (a, d), r in reports.items()}},
        indent=2))


if __name__ == "__main__":
    main()

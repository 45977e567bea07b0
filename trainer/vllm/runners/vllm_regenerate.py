"""Regenerate chat answers with the target in vLLM (continuous batching). Runs with the Python
of a vLLM environment (it imports only vllm and the standard library, never draftsmith):

    .vllm-venv/bin/python trainer/vllm/runners/vllm_regenerate.py --target HF_DIR --requests requests.json \
        --results results.jsonl --report report.json [--shard I --num-shards N]

requests.json: {"conversations": [[{"role", "content"}, ...], ...] (the assistant turns are
replaced, in order), "chat_template": Jinja text, "max_new_tokens", "temperature", "top_p",
"top_k", "seed", "dtype", "max_model_len" (the bound on prompt + answer), "engine_max_model_len" (the
engine's, when larger: a LongRoPE target), "concurrency" (vLLM's max_num_seqs: requests decoded
together), "tensor_parallel_size", "prefix_caching", "enforce_eager" (null: on the CPU only),
"logprobs" (top-k logprobs per generated token, 0: none), "truncated" (keep | drop: an answer cut
at max_new_tokens ends its conversation under drop; an empty answer always does)}.

Data parallelism is the caller's: N runners, each with `--shard I --num-shards N` (the
conversations c with c % N == I) on its own devices (vLLM's LLM() takes no data_parallel_size in
one process).

Assistant turn j of a conversation is generated after the target's own answers to turns < j:
one round per turn index, the conversations that have it batched together. A prompt is the
conversation so far rendered with the chat template and the generation prompt, tokenized as
draftsmith tokenizes it (the text, no special tokens added). results.jsonl gets one line per
answer, appended and flushed a chunk of requests at a time: {"conv", "turn", "token_ids",
"text", "finish_reason"} or {"conv", "turn", "skip": "prompt_too_long"} (no room for an answer
within max_model_len). A rerun with the same requests reads the lines already there and
generates only the rest, in the same chunks, so a killed run continues where it stopped and
ends with the same results (greedy, or sampled with a per-request seed; prefix caching off:
with it, a resumed run would compute cached prefixes another way).
report.json: the vLLM version, the engine start and generation seconds, tokens generated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from runner_common import inspect_models_in_process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    args = ap.parse_args()
    with open(args.requests) as f:
        req = json.load(f)
    convs = req["conversations"]
    mine = [c for c in range(len(convs)) if c % args.num_shards == args.shard]

    done: dict[tuple[int, int], dict] = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            for line in f:
                if line.endswith("\n"):  # a line cut by a kill is redone
                    r = json.loads(line)
                    done[(r["conv"], r["turn"])] = r

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.platforms import current_platform

    inspect_models_in_process()
    eager = req.get("enforce_eager")
    llm = LLM(model=args.target, tokenizer=args.target, dtype=req.get("dtype", "float32"),
              enforce_eager=current_platform.is_cpu() if eager is None else eager,
              max_model_len=req.get("engine_max_model_len") or req["max_model_len"],
              max_num_seqs=req.get("concurrency", 8), seed=req.get("seed", 0),
              tensor_parallel_size=req.get("tensor_parallel_size", 1),
              enable_prefix_caching=bool(req.get("prefix_caching", False)))
    tokenizer = llm.get_tokenizer()
    started = time.perf_counter() - t0

    def ends_well(r) -> bool:
        """An answer the conversation goes on from: not empty, and not cut at max_new_tokens
        when the requests drop those (truncated: drop)."""
        return bool(r.get("text")) and not (req.get("truncated") == "drop" and r.get("finish_reason") == "length")

    def prompt_ids(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             chat_template=req["chat_template"])
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    turns = {c: [j for j, m in enumerate(convs[c]) if m["role"] == "assistant"] for c in mine}
    work = {c: [dict(m) for m in convs[c]] for c in mine}
    stopped = set()  # conversations that ended early: later turns have no prompt
    chunk = max(4 * req.get("concurrency", 8), 32)
    generated, gen_s = 0, 0.0
    fault = int(os.environ.get("DRAFTSMITH_FAULT_REGENERATE_AFTER_CHUNKS", "0"))
    chunks_run = 0
    with open(args.results, "a") as out:
        for a in range(max((len(t) for t in turns.values()), default=0)):
            todo = []
            for c, t in turns.items():
                if a >= len(t) or c in stopped:
                    continue
                j = t[a]
                if (c, j) in done:
                    r = done[(c, j)]
                    if "skip" in r or not ends_well(r):
                        stopped.add(c)
                    else:
                        work[c][j]["content"] = r["text"]
                    continue
                todo.append((c, j))
            for b in range(0, len(todo), chunk):
                batch, prompts, params = [], [], []
                for c, j in todo[b:b + chunk]:
                    ids = prompt_ids(work[c][:j])
                    room = req["max_model_len"] - len(ids)
                    if room < 1:
                        out.write(json.dumps({"conv": c, "turn": j, "skip": "prompt_too_long"}) + "\n")
                        stopped.add(c)
                        continue
                    batch.append((c, j))
                    prompts.append(TokensPrompt(prompt_token_ids=ids))
                    sampled = req.get("temperature", 0.0) > 0
                    params.append(SamplingParams(
                        max_tokens=min(req["max_new_tokens"], room), temperature=req.get("temperature", 0.0),
                        top_p=req.get("top_p", 1.0), top_k=req.get("top_k", 0) or -1,
                        seed=(req.get("seed", 0) * 1_000_003 + c * 1009 + j) if sampled else None,
                        logprobs=req.get("logprobs") or None))
                t1 = time.perf_counter()
                results = llm.generate(prompts, params, use_tqdm=False) if prompts else []
                gen_s += time.perf_counter() - t1
                for (c, j), res in zip(batch, results):
                    o = res.outputs[0]
                    text = tokenizer.decode(o.token_ids, skip_special_tokens=True).strip()
                    r = {"conv": c, "turn": j, "token_ids": list(o.token_ids), "text": text,
                         "finish_reason": o.finish_reason}
                    if req.get("logprobs"):
                        r["top_logprobs"] = [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])
                                             [:req["logprobs"]] for pos in o.logprobs]
                    out.write(json.dumps(r) + "\n")
                    work[c][j]["content"] = text
                    generated += len(o.token_ids)
                    if not ends_well(r):  # an empty answer (or a cut one, dropped): no later turn of it
                        stopped.add(c)
                out.flush()
                os.fsync(out.fileno())
                chunks_run += 1
                if fault and chunks_run >= fault:
                    os._exit(17)  # tests: a kill between chunks
    report = {"vllm": vllm.__version__, "engine_start_s": started, "generate_s": gen_s, "tokens": generated,
              "tokens_per_s": generated / gen_s if gen_s else 0.0}
    tmp = args.report + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, args.report)
    print(json.dumps(report), file=sys.stderr)


if __name__ == "__main__":
    main()

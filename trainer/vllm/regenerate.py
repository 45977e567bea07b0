"""Regenerate chat answers through vLLM: the requests for trainer/vllm/runners/vllm_regenerate.py, its
runners (one per data-parallel engine, each on its own devices), their results merged, and
resume: the work lives in a folder named by the sha256 of the requests (the target, the chat
template, the conversations and every setting), so a killed `draftsmith prepare` run again with
the same config continues there, and ends with the records an uninterrupted run writes.

Records are trainer/data/regenerate.py's (the HF engine writes the same), applied to the
conversations by its `apply_answers`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trainer.io import atomic_write_json
from trainer.vllm.env import RUNNERS, engine_devices, require_vllm_python, run_runners, runner_env

RUNNER = RUNNERS / "vllm_regenerate.py"


def requests_for(conversations: list[list[dict]], chat_template: str, rg, max_model_len: int, seed: int,
                 logprobs: int = 0, engine_max_model_len: int | None = None) -> dict:
    """The runner's requests.json (its docstring names each field); `engine_max_model_len`: the
    engine's own when it must exceed the answers' bound (a LongRoPE target: trainer/families.py)."""
    return {"conversations": conversations, "chat_template": chat_template, "max_new_tokens": rg.max_new_tokens,
            "temperature": rg.temperature, "top_p": rg.top_p, "top_k": rg.top_k, "seed": seed, "dtype": rg.dtype,
            "max_model_len": max_model_len, "engine_max_model_len": engine_max_model_len or max_model_len,
            "concurrency": rg.concurrency,
            "tensor_parallel_size": rg.tensor_parallel_size, "prefix_caching": rg.prefix_caching,
            "truncated": rg.truncated, "logprobs": logprobs}


def work_dir(root: Path, requests: dict) -> Path:
    digest = hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / digest


def regenerate_in_vllm(target_dir: str, requests: dict, work: Path, data_parallel_size: int = 1,
                       vllm_cache: Path | None = None, progress=None,
                       timeout: float | None = None) -> tuple[list, dict]:
    """Run the runners over `requests` in `work` (made, or continued), one per data-parallel
    engine; returns (the records, in conversation and turn order; the run report: vLLM's
    version, engine start seconds, generation seconds and tokens/s over the engines)."""
    python = require_vllm_python("regenerate.engine=vllm")
    work.mkdir(parents=True, exist_ok=True)
    req_file = work / "requests.json"
    if not req_file.is_file():
        atomic_write_json(req_file, requests)
    N, T = data_parallel_size, requests["tensor_parallel_size"]
    results = [work / f"results-{i}.jsonl" for i in range(N)]
    reports = [work / f"report-{i}.json" for i in range(N)]
    for r in reports:
        r.unlink(missing_ok=True)
    cmds = [[python, str(RUNNER), "--target", str(target_dir), "--requests", str(req_file), "--results",
             str(results[i]), "--report", str(reports[i]), "--shard", str(i), "--num-shards", str(N)]
            for i in range(N)]
    cpus = os.cpu_count() or 1
    envs = [runner_env(vllm_cache, in_process=T == 1,
                       devices=engine_devices(i, T) if N > 1 else None,
                       threads=max(1, cpus // N) if N > 1 else None) for i in range(N)]
    seen = [0] * N  # bytes of each results file already counted
    lines = [0]

    def poll() -> None:  # count new answers, reading only what was appended
        for i, f in enumerate(results):
            if f.is_file() and f.stat().st_size > seen[i]:
                with open(f, "rb") as fh:
                    fh.seek(seen[i])
                    chunk = fh.read()
                seen[i] += len(chunk)
                n = chunk.count(b"\n")
                lines[0] += n
                if progress is not None and n:
                    progress(n)

    run_runners(cmds, envs, [work / f"runner-{i}.log" for i in range(N)], timeout, poll, "vLLM regeneration")
    records = []
    for f in results:
        with open(f) as fh:
            records += [json.loads(line) for line in fh if line.endswith("\n")]
    records.sort(key=lambda r: (r["conv"], r["turn"]))
    runs = [json.loads(r.read_text()) for r in reports]
    gen_s = max(r["generate_s"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    report = {"engine": "vllm", "version": runs[0]["vllm"], "engines": N,
              "engine_start_s": max(r["engine_start_s"] for r in runs), "generate_s": gen_s,
              "tokens_this_run": tokens, "tokens_per_s": tokens / gen_s if gen_s else 0.0}
    return records, report

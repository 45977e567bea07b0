"""Capture a target's hidden states through vLLM into draftsmith capture shards. Runs with the
Python of a vLLM environment:

    .vllm-venv/bin/python trainer/vllm/runners/vllm_capture.py --target HF_DIR --jobs JOBS_DIR --out CAPTURE_DIR \
        --settings settings.json [--shard I --num-shards N]

The target runs under vLLM's `extract_hidden_states` speculative method with draftsmith's KV
connector (draftsmith_states.py and draftsmith_capture_connector.py, beside this file), which
writes each request's states at the requested layers plus the last layer's output before the
final norm (layer id num_layers) to a file, read and deleted at once; the greedy next token at
every position comes from the same forward (prompt_logprobs=1: the top-1 token at each position;
the last position's from the one token sampled greedily). Each job file
JOBS_DIR/shard-KKKKK.safetensors (input_ids, loss_mask, cu_seqlens, sample_index: the samples of
capture shard K) becomes CAPTURE_DIR/shard-KKKKK.safetensors
and its sidecar, written by draftsmith's own shard writer (trainer/data/shards.py: the same
tensors, store dtype, float8 scales, sha256 and atomic writes as the transformers engine), which
this runner loads from the repository; it imports nothing else of draftsmith (the module needs
only torch, safetensors and the standard library). Every job given is done (the recipe gives
only the shards still to do: missing, or failing their sha256), so a killed run is resumed, and
a corrupt shard repaired, by running again.

settings.json: {"aux_layer_ids", "num_layers", "store_dtype", "dtype", "max_model_len",
"concurrency", "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager" (null: on the
CPU only), "max_num_batched_tokens" (null: vLLM's)}. Data parallelism is the caller's (N
runners, `--shard I --num-shards N`: the jobs K with K % N == I, each on its own devices).
Writes CAPTURE_DIR/.vllm-capture-report-I.json: vLLM's version, engine start and capture seconds,
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from runner_common import beside_draftsmith, inspect_models_in_process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    args = ap.parse_args()
    with open(args.settings) as f:
        cfg = json.load(f)
    beside_draftsmith()  # the connector for vLLM (and its TP workers) by name; draftsmith's shard writer
    inspect_models_in_process()

    from safetensors.torch import load_file

    from trainer.data.shards import pack_samples, write_shard

    out, jobs_dir = Path(args.out), Path(args.jobs)
    jobs = sorted(p for p in jobs_dir.glob("shard-*.safetensors") if int(p.stem.split("-")[1]) % args.num_shards ==
                  args.shard)  # every job given is done: the recipe gives only the shards still to do
    staging = out / f".vllm-states-{args.shard}"
    report = {"tokens": 0, "engine_start_s": 0.0, "capture_s": 0.0, "shards": 0}
    if jobs:
        t0 = time.perf_counter()
        import vllm
        from draftsmith_states import StatesEngine

        engine = StatesEngine(args.target, cfg, staging)
        report["engine_start_s"] = time.perf_counter() - t0
        report["vllm"] = vllm.__version__
        for job in jobs:
            k = int(job.stem.split("-")[1])
            t1 = time.perf_counter()
            j = load_file(str(job))
            cu = j["cu_seqlens"].tolist()
            samples = [j["input_ids"][cu[s]:cu[s + 1]] for s in range(len(cu) - 1)]
            packed = [{**states, "loss_mask": j["loss_mask"][cu[s]:cu[s + 1]]}
                      for s, states in enumerate(engine.states(samples, f"shard{k}"))]
            write_shard(out, k, pack_samples(packed, j["sample_index"].tolist()), cfg["aux_layer_ids"])
            report["tokens"] += cu[-1]
            report["shards"] += 1
            report["capture_s"] += time.perf_counter() - t1
            print(json.dumps({"shard": k, "tokens": cu[-1]}), file=sys.stderr, flush=True)
            if 0 < int(os.environ.get("DRAFTSMITH_FAULT_CAPTURE_AFTER_BATCHES", "0")) <= report["shards"]:
                os._exit(17)  # tests: a kill between shards (the transformers engine counts batches)
    shutil.rmtree(staging, ignore_errors=True)  # the states' files were read and removed; the flush's too
    tmp = out / f".vllm-capture-report-{args.shard}.json.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out / f".vllm-capture-report-{args.shard}.json")


if __name__ == "__main__":
    main()

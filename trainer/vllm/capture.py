"""Capture through vLLM: the target served by vLLM (its own environment; tensor, pipeline and data
parallelism for targets beyond one device), its hidden states written by draftsmith's KV
connector into the capture's own shards (trainer/vllm/runners/vllm_capture.py says how). The recipe
(recipes/capture.py) decides which shards are still to do (resume), writes their jobs here, and
writes the manifest afterwards, exactly as for the transformers engine.

Multi-node: vLLM runs an engine across nodes through Ray (`ray start` on each node, then the
same command with tensor_parallel_size x pipeline_parallel_size covering them,
https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html); draftsmith starts no cluster.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from trainer.data.shards import shard_name
from trainer.families import served_max_model_len
from trainer.io import atomic_write_json
from trainer.vllm.env import RUNNERS, engine_devices, require_vllm_python, run_runners, runner_env

RUNNER = RUNNERS / "vllm_capture.py"
JOBS = ".vllm-jobs"


def write_jobs(out: Path, shards: dict[int, range], ds) -> Path:
    """One job file per shard to do: its samples' input_ids and loss_mask packed, cu_seqlens,
    sample_index (the prepared rows)."""
    jobs = out / JOBS
    shutil.rmtree(jobs, ignore_errors=True)  # a killed run's jobs: the runner does every job it finds
    jobs.mkdir(parents=True)
    for k, rows in shards.items():
        sel = ds.select(rows)
        ids, masks = sel["input_ids"], sel["loss_mask"]
        cu = torch.zeros(len(ids) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(x) for x in ids]), 0, out=cu[1:])
        save_file({"input_ids": torch.tensor([t for x in ids for t in x], dtype=torch.int32),
                   "loss_mask": torch.tensor([t for m in masks for t in m], dtype=torch.uint8),
                   "cu_seqlens": cu, "sample_index": torch.tensor(list(rows), dtype=torch.int64)},
                  str(jobs / shard_name(k)))
    return jobs


def capture_in_vllm(target_dir: str, out: Path, shards: dict[int, range], ds, layer_ids: list[int], num_layers: int,
                    cfg, progress=None, vllm_cache: Path | None = None) -> dict:
    """Capture `shards` ({k: prepared rows}) into `out` with vLLM; returns the run report (vLLM's
    version, engine start seconds, capture seconds and tokens over the engines)."""
    python = require_vllm_python("capture engine=vllm")
    jobs = write_jobs(out, shards, ds)
    longest = max((len(x) for rows in shards.values() for x in ds.select(rows)["input_ids"]), default=1)
    engine_len = served_max_model_len(AutoConfig.from_pretrained(target_dir).get_text_config(), longest + 1)
    settings = {"aux_layer_ids": layer_ids, "num_layers": num_layers, "store_dtype": cfg.store_dtype,
                "dtype": cfg.target_dtype, "max_model_len": engine_len, "concurrency": cfg.concurrency,
                "tensor_parallel_size": cfg.tensor_parallel_size,
                "pipeline_parallel_size": cfg.pipeline_parallel_size, "enforce_eager": None,
                "max_num_batched_tokens": None}
    atomic_write_json(jobs / "settings.json", settings)
    N, T = cfg.data_parallel_size, cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    cmds = [[python, str(RUNNER), "--target", str(target_dir), "--jobs", str(jobs), "--out", str(out), "--settings",
             str(jobs / "settings.json"), "--shard", str(i), "--num-shards", str(N)] for i in range(N)]
    cpus = os.cpu_count() or 1
    envs = [runner_env(vllm_cache, in_process=T == 1,
                       devices=engine_devices(i, T) if N > 1 else None, threads=max(1, cpus // N) if N > 1 else None)
            for i in range(N)]
    done = set()

    def poll() -> None:  # a shard's sidecar appears when it is complete
        if progress is None:
            return
        for k in shards:
            if k not in done and (out / shard_name(k)).with_suffix(".json").is_file():
                done.add(k)
                progress(sum(len(x) for x in ds.select(shards[k])["input_ids"]))

    try:
        run_runners(cmds, envs, [jobs / f"runner-{i}.log" for i in range(N)], poll=poll, what="vLLM capture")
    except BaseException:  # the complete shards and capture_state.json stay (a rerun resumes); of the jobs, the
        for job in jobs.glob("shard-*.safetensors"):  # logs the error line names, not the copies of the data
            job.unlink(missing_ok=True)
        raise
    reports = [json.loads((out / f".vllm-capture-report-{i}.json").read_text()) for i in range(N)]
    for i in range(N):
        (out / f".vllm-capture-report-{i}.json").unlink()
    shutil.rmtree(jobs, ignore_errors=True)
    seconds = max(r["engine_start_s"] + r["capture_s"] for r in reports)
    capture_s = max(r["capture_s"] for r in reports)
    tokens = sum(r["tokens"] for r in reports)
    return {"engine": "vllm", "version": next((r["vllm"] for r in reports if "vllm" in r), None), "engines": N,
            "engine_start_s": max(r["engine_start_s"] for r in reports), "capture_s": capture_s,
            "seconds": seconds, "tokens": tokens}

"""The vLLM producer of an online training run: the target served by vLLM in its own environment
and on its own devices (trainer/vllm/runners/vllm_produce.py), streaming hidden states to the
trainer ranks through the run's Ray channel (trainer/online/channel.py). `online.data_parallel_size`
producers side by side each take the oldest requests (the channel hands a rank its samples in
order whatever finished first); tensor and pipeline parallelism are each producer's engine's.

A producer started here leads its own process group (a session of its own): vLLM's engine core
and, with tensor or pipeline parallelism, its workers are in it, and stopping the producer ends
the whole group. It dies with the trainer, group and all: on Linux the runner asks the kernel
for a signal when the trainer goes (set by the runner itself after exec: a `preexec_fn` would
run in the forked child of a trainer whose threads, Ray's, are running, which CPython documents
can deadlock) and ends its group on it; elsewhere it sees the trainer's pid gone, or the channel
gone, within a second.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json
from trainer.target import TARGET_DTYPES
from trainer.vllm.env import RUNNERS, engine_devices, log_cause, require_vllm_python, runner_env

RUNNER = RUNNERS / "vllm_produce.py"


@dataclass
class Producer:
    procs: list
    logs: list[Path]
    kept: Path | None = None  # where the logs are copied, when the run's folder may go (keep_logs)

    def alive(self) -> bool:
        """Every producer still runs."""
        return all(p.poll() is None for p in self.procs)

    def describe(self) -> str:
        logs = [self.kept / log.name for log in self.logs] if self.kept is not None else self.logs
        dead = [(p, log, kept) for p, log, kept in zip(self.procs, self.logs, logs) if p.poll() is not None]
        if dead:
            p, log, kept = dead[0]
            return f"the vLLM producer (pid {p.pid}, exit {p.returncode}; log {kept}; {log_cause(log)})"
        return f"the vLLM producer (pid {', '.join(str(p.pid) for p in self.procs)}; log {logs[0]})"

    def keep_logs(self, folder: Path) -> None:
        """Copy the logs into `folder` (again after `stop`: what they say last), which `describe` then names:
        a run that fails before its first checkpoint removes its folder, and the logs with it."""
        self.kept = folder
        folder.mkdir(parents=True, exist_ok=True)
        for log in self.logs:
            if log.is_file():
                shutil.copyfile(log, folder / log.name)

    def stop(self, grace_s: float = 5.0) -> None:
        """A producer ends by itself once the channel is closed; after `grace_s` seconds its whole
        process group (vLLM's engine core and workers) is killed, whatever still runs in it."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            kill_group(p.pid)
            p.wait()
        if self.kept is not None:
            self.keep_logs(self.kept)


def kill_group(pgid: int) -> None:
    """SIGKILL the process group `pgid` (a producer's: its pid), whatever is left of it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_producers(target_dir: str, address: str, channel: str, settings: dict, work: Path,
                    data_parallel_size: int = 1, devices: list[str] | None = None,
                    vllm_cache: Path | None = None) -> Producer:
    """`data_parallel_size` producers joining the cluster at `address`, each on its slice of
    `devices` (CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES; None: the visible ones), their states'
    files in `work` a chunk at a time, their logs there too."""
    python = require_vllm_python("online.engine=vllm")
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(work / "settings.json", settings)
    per_engine = settings["tensor_parallel_size"] * settings["pipeline_parallel_size"]
    cpus = os.cpu_count() or 1
    procs, logs = [], []
    for i in range(data_parallel_size):
        if devices is not None:
            mine = devices[i * per_engine:(i + 1) * per_engine]
        else:
            mine = engine_devices(i, per_engine) if data_parallel_size > 1 else None
        env = runner_env(vllm_cache, in_process=per_engine == 1, devices=mine,
                         threads=max(1, cpus // data_parallel_size) if data_parallel_size > 1 else None)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        log = work / f"producer-{i}.log"
        cmd = [python, str(RUNNER), "--address", address, "--channel", channel, "--target", str(target_dir),
               "--settings", str(work / "settings.json"), "--staging", str(work / f"states-{i}"),
               "--trainer-pid", str(os.getpid())]
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        (work / f"producer-{i}.pid").write_text(f"{procs[-1].pid}\n")
        logs.append(log)
    return Producer(procs, logs)


def settings_for(online, layer_ids: list[int], num_layers: int, max_model_len: int, dtype: str) -> dict:
    """The producer's StatesEngine settings from the run's `online` section (`max_model_len`: the
    engine's, trainer.families.served_max_model_len; `dtype`: the target's, unless online.target_dtype)."""
    return {"aux_layer_ids": list(layer_ids), "num_layers": num_layers, "store_dtype": online.store_dtype,
            "dtype": online.target_dtype or dtype, "max_model_len": max_model_len, "concurrency": online.concurrency,
            "tensor_parallel_size": online.tensor_parallel_size,
            "pipeline_parallel_size": online.pipeline_parallel_size, "enforce_eager": None,
            "max_num_batched_tokens": None, "flush_timeout_s": online.timeout_s,
            "gpu_memory_utilization": online.gpu_memory_utilization}


def served_dtype(hf_dir: str | Path) -> str:
    """The dtype the target's own weights are in, for the engine to run it in (online.target_dtype
    null): its config.json's `dtype` (`torch_dtype` before transformers 5; a multimodal config's
    text part where the top names none); float32 where it names none."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    for part in (config, config.get("text_config") or {}):
        name = part.get("dtype") or part.get("torch_dtype")
        if name:
            name = str(name).removeprefix("torch.")
            if name not in TARGET_DTYPES:
                raise DraftsmithError(f"{path}: the target's dtype {name!r} is none the producer runs; set "
                                      f"online.target_dtype to one of {', '.join(TARGET_DTYPES)}")
            return name
    return "float32"

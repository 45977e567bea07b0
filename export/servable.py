"""Can the vLLM a user will serve with serve this algorithm's draft for this target? Asked at
capture and training start (before hours of work) and at export (on the serve line).

An EAGLE-3, DFlash or DSpark draft reads the target's aux hidden states, which vLLM takes only
from a target class that implements `SupportsEagle3`
(vllm/model_executor/models/interfaces.py; the model runner raises "Model does not support
EAGLE3 interface" at load otherwise). The answer comes from the installed vLLM when there is
one (export/runners/vllm_servable.py, through the runner pattern: the vLLM environment's
Python), cached per vLLM install; otherwise from `vllm_servable_0.32.json`, recorded from
vLLM 0.32.0's own registry by the same runner (`--all`), which names its version.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "runners" / "vllm_servable.py"
TABLE = Path(__file__).resolve().parent / "vllm_servable_0.32.json"


@dataclass
class Servability:
    servable: bool
    line: str  # one line that says so, naming the architecture, the method and the vLLM consulted


def _installed_report(architectures: list[str]) -> dict | None:
    """The installed vLLM's answer (export/runners/vllm_servable.py), cached on disk per vLLM
    install and architecture list; None without a vLLM environment or when it cannot answer."""
    from export.vllm_env import vllm_python
    from trainer.target import cache_root

    python = vllm_python()
    if python is None or not Path(python).exists():
        return None
    stamp = Path(python).resolve().parent.parent / "lib"  # the install: its site-packages change on reinstall
    key = f"{Path(python).resolve()}|{stamp.stat().st_mtime_ns if stamp.exists() else 0}|{','.join(architectures)}"
    cache = cache_root() / "servable.json"
    try:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
    except (ValueError, OSError):
        known = {}
    if key in known:
        return known[key]
    out = cache_root() / f"servable-{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_CACHE_ROOT", str(cache_root() / "vllm-cache"))
    try:
        r = subprocess.run([python, str(RUNNER), "--architectures", *architectures, "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
        if r.returncode != 0 or not out.is_file():
            return None
        report = json.loads(out.read_text())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    finally:
        out.unlink(missing_ok=True)
    known[key] = report
    from trainer.io import atomic_write_json

    try:
        atomic_write_json(cache, known)
    except OSError:
        pass  # a cache that cannot be written only costs the next call its vLLM start
    return report


def servability(architectures: list[str], algorithm: str) -> Servability:
    """Whether a draft of `algorithm` can be served for a target of `architectures` (its HF
    config's), by the installed vLLM when there is one, else by the table recorded from 0.32."""
    from export.formats import exporter

    method = exporter(algorithm).METHOD
    archs = list(architectures or [])
    report = _installed_report(archs) if archs else None
    where = f"the installed vLLM {report['vllm']}" if report else None
    if report is None:
        report = json.loads(TABLE.read_text())
        where = f"vLLM {report['vllm']} (a table recorded from its model registry; no vLLM environment here)"
    if not archs:
        return Servability(False, f"the target's config names no architecture, so {where} cannot be asked whether it "
                                  f"serves {method} drafts for it")
    rows = {a: report["architectures"].get(a, {"registered": False, "supports_eagle3": False}) for a in archs}
    ok = [a for a, row in rows.items() if row.get("supports_eagle3")]
    if method not in report["methods"]:
        return Servability(False, f"{where} has no speculative method '{method}'")
    if ok:
        return Servability(True, f"{where} serves {method} drafts for {ok[0]} (it implements SupportsEagle3)")
    arch = archs[0]
    why = "is not a model it registers" if not rows[arch].get("registered") else \
        "does not implement SupportsEagle3 (it exposes no aux hidden states to a draft)"
    return Servability(False, f"{where} cannot serve {method} drafts for this target: {arch} {why}; a draft "
                              "trained for it cannot be served there")


def check_servable(target_spec: str, algorithms: list[str], require: bool, stage: str) -> list[str]:
    """The servability of each algorithm for the target `target_spec` names, read from its config
    alone (no weights: a stage asks before any work): one warning line each where it is not
    servable (returned, for the stage to print), or with `require` an error."""
    from trainer.errors import DraftsmithError
    from trainer.target import target_architectures

    archs = target_architectures(target_spec)
    warnings = []
    for algorithm in algorithms:
        s = servability(archs, algorithm)
        if not s.servable:
            if require:
                raise DraftsmithError(f"{stage}: {s.line} (require_servable=true; set it false to go on anyway)")
            warnings.append(f"warning: {stage}: {s.line} (require_servable=true makes this an error)")
    return warnings

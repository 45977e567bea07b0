"""Can the vLLM a user will serve with serve drafts of this speculative method (vLLM's name: an
exporter's METHOD) for this target? Asked at capture and training start (before hours of
work) and at export (on the serve line).

An EAGLE-3, DFlash or DSpark draft reads the target's aux hidden states, which vLLM takes only
from a target class that implements `SupportsEagle3`
(vllm/model_executor/models/interfaces.py, vLLM 0.32 and 0.34; the model runner raises "Model does not support
EAGLE3 interface" at load otherwise: 0.32's vllm/v1/worker/gpu_model_runner.py, 0.34's
vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py). The answer comes from the installed vLLM when there is
one (trainer/vllm/runners/vllm_servable.py, through the runner pattern: the vLLM environment's
Python), cached per vLLM install; otherwise from `vllm_servable_0.32.json`, recorded from
vLLM 0.32.0's own registry by the same runner (`--all`), which names its version. The installed
vLLM also reads the target's config.json as its engine start would (with its own transformers,
which may be older than draftsmith's): a config it cannot read is not servable there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import DraftsmithError
from trainer.families import embedding_name, is_longrope, longrope_note
from trainer.io import atomic_write_json
from trainer.target import TargetSource, cache_root, resolve_target, target_architectures, target_config, target_hf_dir
from trainer.vllm.env import require_vllm_python, shared_vllm_cache, vllm_python

RUNNER = Path(__file__).resolve().parent / "runners" / "vllm_servable.py"
TABLE = Path(__file__).resolve().parent / "vllm_servable_0.32.json"


@dataclass
class Servability:
    servable: bool
    line: str  # one line that says so, naming the architecture, the method and the vLLM consulted


def config_digest(folder: Path) -> str:
    """What a config read is cached by: the sha256 of the folder's config.json."""
    return hashlib.sha256((Path(folder) / "config.json").read_bytes()).hexdigest()


def _installed_report(architectures: list[str], configs: list[Path] = ()) -> dict | None:
    """The installed vLLM's answer (trainer/vllm/runners/vllm_servable.py) for these architectures
    and whether it reads these target folders' config.json ("configs", by config_digest), cached
    on disk per vLLM install, architecture and config (one vLLM start answers everything not yet
    known); None without a vLLM environment or when it cannot answer."""
    python = vllm_python()
    if python is None or not Path(python).exists():
        return None
    # the install: its site-packages folder changes when anything (vLLM, draftsmith's plugin) is installed there
    stamp = next(Path(python).absolute().parent.parent.glob("lib/python*/site-packages"), Path("/nonexistent"))
    asked = hashlib.sha256(RUNNER.read_bytes()).hexdigest()[:16]  # what the runner reports changes with it
    key = f"{Path(python).resolve()}|{stamp.stat().st_mtime_ns if stamp.exists() else 0}|{asked}"
    cache = cache_root() / "servable.json"
    try:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
    except (ValueError, OSError):
        known = {}
    mine = known.get(key) if isinstance(known.get(key), dict) else None
    folders = {config_digest(folder): Path(folder) for folder in configs}
    missing = [a for a in architectures if mine is None or a not in mine["architectures"]]
    unread = [d for d in folders if mine is None or d not in mine.get("configs", {})]
    if missing or unread or mine is None:
        out = cache_root() / f"servable-{os.getpid()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.setdefault("VLLM_CACHE_ROOT", str(shared_vllm_cache(python)))
        env["HF_HUB_OFFLINE"] = "1"  # local folders only: no Hub lookups for a config
        try:
            r = subprocess.run([python, str(RUNNER), "--architectures", *missing,
                                "--configs", *[str(folders[d]) for d in unread], "--out", str(out)],
                               capture_output=True, text=True, timeout=300, env=env)
            if r.returncode != 0 or not out.is_file():
                return None
            report = json.loads(out.read_text())
            report["configs"] = {d: report["configs"][str(folders[d])] for d in unread}
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            return None
        finally:
            out.unlink(missing_ok=True)
        mine = {**report, "architectures": {**(mine or {}).get("architectures", {}), **report["architectures"]},
                "configs": {**(mine or {}).get("configs", {}), **report["configs"]}}
        try:  # another process may have added architectures or configs meanwhile: re-read, merge, write
            latest = json.loads(cache.read_text()) if cache.is_file() else {}
            theirs = latest.get(key) if isinstance(latest.get(key), dict) else {}
            for part in ("architectures", "configs"):
                mine[part] = {**theirs.get(part, {}), **mine[part]}
            atomic_write_json(cache, {**latest, key: mine})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # a cache that cannot be written only costs the next call its vLLM start
    return {**mine, "architectures": {a: mine["architectures"][a] for a in architectures},
            "configs": {d: mine["configs"][d] for d in folders}}


def ask_installed_vllm(architectures: list[str], targets: list[Path] = ()) -> None:
    """The installed vLLM asked about all these architectures and target folders' configs at once
    (one vLLM start), so that each later servability check for one of them is answered from the cache."""
    _installed_report(sorted(set(architectures)), list(targets))


# Methods whose vLLM draft cannot be built over a LongRoPE target: vLLM's DFlash (and DSpark, its
# subclass) reads its rotary embedding's `cos_sin_cache` for the context keys
# (qwen3_dflash.py), which the LongRoPE embedding (phi3_long_rope_scaled_rope.py) does not have.
NO_LONGROPE = ("dflash", "dspark")


# The names vLLM's proposer looks for the target's token embedding under, in its inner `model`
# (v1/spec_decode/llm_base_proposer.py in vLLM 0.32, _maybe_share_embeddings).
SHARED_EMBEDDING_NAMES = ("embed_tokens", "embedding")


def servability(architectures: list[str], method: str, longrope: bool = False,
                embedding: str | None = None, config: Path | None = None) -> Servability:
    """Whether a draft of vLLM's speculative `method` can be served for a target of
    `architectures` (its HF config's; `longrope`: its RoPE is LongRoPE; `embedding`: the
    attribute its HF base model holds the token embedding under; `config`: its HF folder, whose
    config.json the installed vLLM must read), by the installed vLLM when there is one, else by
    the table recorded from 0.32."""
    archs = list(architectures or [])
    configs = [Path(config)] if config is not None and (Path(config) / "config.json").is_file() else []
    report = _installed_report(archs, configs) if archs else None
    where = f"the installed vLLM {report['vllm']}" if report else None
    if report is None:
        report = json.loads(TABLE.read_text())
        where = f"vLLM {report['vllm']} (a table recorded from its model registry; no vLLM environment here)"
    if not archs:
        return Servability(False, f"the target's config names no architecture, so {where} cannot be asked whether it "
                                  f"serves {method} drafts for it")
    read = next(iter(report.get("configs", {}).values()), {"ok": True}) if configs else {"ok": True}
    if not read.get("ok"):
        return Servability(False, f"{where} cannot read this target's {configs[0] / 'config.json'} with its "
                                  f"transformers {report.get('transformers', '?')} ({read.get('error')}); upgrade "
                                  "transformers in the vLLM environment (with its pip), or serve with a vLLM that "
                                  "reads this model's config")
    rows = {a: report["architectures"].get(a, {"registered": False, "supports_eagle3": False}) for a in archs}
    ok = [a for a, row in rows.items() if row.get("supports_eagle3")]
    if method not in report["methods"]:
        return Servability(False, f"{where} has no speculative method '{method}'")
    if ok and embedding and embedding not in SHARED_EMBEDDING_NAMES and rows[ok[0]].get("transformers_backend"):
        return Servability(False, f"{where} cannot serve {method} drafts for this target: it runs {ok[0]} through its "
                                  f"Transformers backend, whose model names the token embedding '{embedding}', and "
                                  "its proposer shares only an 'embed_tokens' or 'embedding' with the draft")
    if ok and longrope and method in NO_LONGROPE:
        return Servability(False, f"{where} cannot build a {method} draft for this target: {ok[0]} uses LongRoPE, "
                                  f"and vLLM's {method} draft reads a cos_sin_cache its LongRoPE embedding lacks "
                                  "(train an EAGLE-3 draft for it)")
    if ok and rows[ok[0]].get("plugin") and method not in plugin_families().get(ok[0], ()):
        return Servability(False, f"{where} cannot serve {method} drafts for this target through draftsmith's vLLM "
                                  f"plugin: no served run has shown {ok[0]}'s {method} drafts count-equal there (the "
                                  f"plugin's VERIFIED_METHODS: {', '.join(plugin_families().get(ok[0], ())) or 'none'}"
                                  "); train one of those")
    if ok and rows[ok[0]].get("plugin"):
        test, build = plugin_proofs()[ok[0], method]
        return Servability(True, f"{where} serves {method} drafts for {ok[0]} with draftsmith's vLLM plugin (installed "
                                 "there: it gives vLLM's own class the SupportsEagle3 interface; served count-equal "
                                 f"with the in-tree decoder by {test} on {build})")
    if ok:
        return Servability(True, f"{where} serves {method} drafts for {ok[0]} (it implements SupportsEagle3)")
    arch = archs[0]
    why = "is not a model it registers" if not rows[arch].get("registered") else \
        "does not implement SupportsEagle3 (it exposes no aux hidden states to a draft)"
    if rows[arch].get("registered") and arch in plugin_families():
        return Servability(False, f"{where} cannot serve {method} drafts for this target: {arch} {why}; draftsmith's "
                                  f"vLLM plugin adds it: {PLUGIN_INSTALL} (then it serves them)")
    return Servability(False, f"{where} cannot serve {method} drafts for this target: {arch} {why}; a draft "
                              "trained for it cannot be served there")


PLUGIN = Path(__file__).resolve().parent / "plugin"  # a distribution of its own, installed beside vLLM
PLUGIN_INSTALL = f"pip install {PLUGIN} with the vLLM environment's pip"


def _plugin_source():
    """draftsmith's vLLM plugin read from its source (it imports vllm only when it registers)."""
    name, package = "_draftsmith_vllm_plugin_source", PLUGIN / "draftsmith_vllm_plugin"
    if name not in sys.modules:  # a package (it imports its own modules), not vLLM's installed copy
        spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                      submodule_search_locations=[str(package)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def plugin_families() -> dict[str, tuple[str, ...]]:
    """The architectures draftsmith's vLLM plugin extends and the methods verified through it for
    each (its VERIFIED_METHODS: served count-equal; none for a family no such run has shown)."""
    plugin = _plugin_source()
    return {arch: tuple(plugin.VERIFIED_METHODS.get(arch, {})) for arch in plugin.FAMILIES}


def plugin_proofs() -> dict[tuple[str, str], tuple[str, str]]:
    """(architecture, method) -> (the served, count-equal run that verified it, the vLLM build it ran on)."""
    return {(arch, method): tuple(proof) for arch, methods in _plugin_source().VERIFIED_METHODS.items()
            for method, proof in methods.items()}


def target_servability(target: str | TargetSource, method: str) -> Servability:
    """`servability` for a target, read from its config alone (no weights)."""
    config = target_config(target)
    source = target if isinstance(target, TargetSource) else resolve_target(target)
    return servability(target_architectures(source), method, is_longrope(config.get_text_config()),
                       embedding_name(config), target_hf_dir(source))


def check_vllm_capture(target: str | TargetSource) -> None:
    """`capture engine=vllm` reads the target's states through vLLM's extract_hidden_states, which
    takes them only from a class with the SupportsEagle3 interface (as a draft does; whatever the
    drafts captured for): refuse a target the installed vLLM has no such class for, before any work,
    in one line (with the plugin's install line where draftsmith's vLLM plugin adds the interface)."""
    require_vllm_python("capture engine=vllm")
    source = target if isinstance(target, TargetSource) else resolve_target(target)
    archs, folder = target_architectures(source), target_hf_dir(source)
    report = _installed_report(archs, [folder]) if archs else None
    if report is None:  # vLLM could not be asked: its engine start will say what is wrong
        return
    where = f"the installed vLLM {report['vllm']}"
    read = next(iter(report["configs"].values()))
    if not read.get("ok"):
        raise DraftsmithError(f"capture engine=vllm: {where} cannot read {folder / 'config.json'} with its "
                              f"transformers {report.get('transformers', '?')} ({read.get('error')}); upgrade "
                              "transformers in the "
                              "vLLM environment (with its pip), or capture with engine=hf")
    rows = report["architectures"]
    if any(row.get("supports_eagle3") for row in rows.values()):
        return
    arch = archs[0]
    if rows[arch].get("registered") and arch in plugin_families():
        raise DraftsmithError(f"capture engine=vllm: {where}'s {arch} does not implement SupportsEagle3, so vLLM "
                              "cannot hand its hidden states out; install draftsmith's vLLM plugin, which adds it: "
                              f"{PLUGIN_INSTALL} (or capture with engine=hf)")
    why = "does not implement SupportsEagle3" if rows[arch].get("registered") else "is not a model it registers"
    raise DraftsmithError(f"capture engine=vllm: {where} cannot capture this target's states: {arch} {why}; capture "
                          "with engine=hf")


def check_servable(target: str | TargetSource, methods: list[str], require: bool, stage: str) -> list[str]:
    """The servability of each speculative method for the target, read from its config alone (no
    weights: a stage asks before any work): one warning line each where it is not servable
    (returned, for the stage to print), or with `require` an error; for a LongRoPE target, the
    line that says how vLLM will serve it (trainer.families.longrope_note)."""
    note = longrope_note(target_config(target).get_text_config(), stage)
    warnings = [note] if note else []
    for method in methods:
        s = target_servability(target, method)
        if not s.servable:
            if require:
                raise DraftsmithError(f"{stage}: {s.line} (require_servable=true; set it false to go on anyway)")
            warnings.append(f"warning: {stage}: {s.line} (require_servable=true makes this an error)")
    return warnings

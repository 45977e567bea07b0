"""The trained-draft folder (recipes/train.py output): written, digested, checked and read
here, and nowhere else.

    <dir>/model.safetensors  the draft's own tensors (state_dict names; no target embedding,
                             no shared LM head), d2t/t2d where it has a draft vocabulary
    <dir>/config.json        {"algorithm", "draft": the Config as a dict, "target": name, path,
                             sha256 and shape, "layer_id_convention", "data", "steps",
                             "weights_sha256", "draft_sha256"}
    <dir>/train_report.json, checkpoints/, logs/ and the run files (config.yaml, ...)

`read_draft` refuses a folder whose weights or draft section were changed after training
(their sha256), a draft trained 0 steps, tensors that are not exactly the module's
state-dict keys, shapes the draft section does not build, and weights holding inf/NaN.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.drafts.registry import DRAFTS, build, get
from trainer.errors import DraftsmithError
from trainer.io import atomic_save_safetensors, atomic_write_json, sha256_file
from trainer.layer_ids import LAYER_ID_CONVENTION

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def config_digest(cfg) -> str:
    """sha256 of a draft config (dataclass or its dict), as recorded in a trained draft's
    config.json: a hand-edited draft section (other layer ids, say) is refused on load."""
    d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def save_draft(out: Path, algorithm: str, draft, state: dict, target, data_desc: dict, steps: int) -> None:
    """model.safetensors (the draft's own weights and d2t/t2d; no target embedding) + config.json
    (the draft config, the target, the steps trained and the weights' sha256, checked on read)."""
    out = Path(out)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    atomic_save_safetensors(out / WEIGHTS, tensors)  # the umask's mode, like every output
    atomic_write_json(out / CONFIG, {
        "algorithm": algorithm, "draft": dataclasses.asdict(draft.config),
        "target": {"name": target.name, "spec": target.spec, "path": target.path, "sha256": target.content_hash,
                   "num_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size},
        "layer_id_convention": LAYER_ID_CONVENTION, "data": data_desc, "steps": steps,
        "weights_sha256": sha256_file(out / WEIGHTS), "draft_sha256": config_digest(draft.config)})


def is_draft_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file() and (Path(path) / WEIGHTS).is_file()


def read_config(path: str | Path) -> dict:
    """A trained draft folder's config.json, checked: what training wrote (the draft section's
    and the weights' sha256), at least one step, a known algorithm."""
    path = Path(path)
    if not is_draft_dir(path):
        raise DraftsmithError(f"'{path}' is not a trained draft folder (needs {CONFIG} and {WEIGHTS}); pass the "
                              "output_dir of recipes/train.py")
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DraftsmithError(f"{path}/{CONFIG} is not valid JSON ({err}); train again or restore it") from None
    if not isinstance(cfg, dict) or "architectures" in cfg:
        raise DraftsmithError(f"'{path}' holds no trained draft's {CONFIG} (an export? export the trained draft "
                              "folder it came from)")
    if cfg.get("algorithm") not in DRAFTS:
        raise DraftsmithError(f"{path}/{CONFIG}: algorithm {cfg.get('algorithm')!r} is not one of {', '.join(DRAFTS)}")
    if cfg.get("steps") == 0:
        raise DraftsmithError(f"'{path}' was trained for 0 steps: its weights are the initialization; train it "
                              "(max_steps >= 1) first")
    if cfg.get("draft_sha256") and config_digest(cfg.get("draft")) != cfg["draft_sha256"]:
        raise DraftsmithError(f"{path}/{CONFIG}: the 'draft' section was changed after training (its sha256 "
                              "differs); restore it or train again")
    if cfg.get("weights_sha256") and sha256_file(path / WEIGHTS) != cfg["weights_sha256"]:
        raise DraftsmithError(f"{path}/{WEIGHTS} does not match the sha256 recorded in {CONFIG} "
                              "(changed after training?); restore it or train again")
    return cfg


def check_finite_weights(tensors, file, remedy: str) -> None:
    """Refuse weights holding inf/NaN, naming the file and the first such tensor: a sha256 vouches
    only that a file is the one recorded, not that it holds numbers (a NaN draft would propose
    nothing and measure τ 1.000). `tensors`: (name, tensor) pairs or a dict; float8 codes are
    read as numbers (e4m3's NaN codes)."""
    for name, t in (tensors.items() if isinstance(tensors, dict) else tensors):
        if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
            bad = int((~torch.isfinite(t.float())).sum())
            raise DraftsmithError(f"{file}: tensor {name} holds {bad} inf/NaN value(s) of {t.numel()}; {remedy}")


def module_shapes(algorithm: str, draft_cfg: dict) -> dict[str, tuple]:
    """The state-dict names and shapes of the draft `draft_cfg` builds (on the meta device:
    no memory): what a trained draft's file must hold, exactly."""
    algo = get(algorithm)
    try:
        with torch.device("meta"):
            module = algo.Draft(algo.Config(**draft_cfg))
    except (TypeError, ValueError, DraftsmithError) as err:
        raise DraftsmithError(f"its config.json 'draft' section does not build a {algorithm} draft ({err})") from None
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def read_draft(path: str | Path) -> tuple[dict, dict]:
    """A trained draft folder -> (its config.json, its tensors by state-dict name), checked:
    the names are exactly the module's, every shape is what the draft section builds."""
    path = Path(path)
    cfg = read_config(path)
    try:
        state = load_file(path / WEIGHTS)
    except Exception as err:  # safetensors' own error types for a damaged file
        raise DraftsmithError(f"{path / WEIGHTS} is not readable safetensors ({err}); train again") from None
    try:
        want = module_shapes(cfg["algorithm"], cfg["draft"])
    except DraftsmithError as err:
        raise DraftsmithError(f"{path / WEIGHTS}: {err}") from None
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise DraftsmithError(f"{path / WEIGHTS}: tensors do not match the {cfg['algorithm']} draft (missing "
                              f"{missing or 'none'}, unexpected {extra or 'none'}); was it written by another version?")
    bad = [f"{k} {tuple(v.shape)} (config says {want[k]})" for k, v in state.items() if tuple(v.shape) != want[k]]
    if bad:
        raise DraftsmithError(f"{path / WEIGHTS}: tensors do not fit the draft config: {'; '.join(bad[:3])}; the "
                              "config or the weights were changed after training")
    check_finite_weights(state, path / WEIGHTS, "a draft of non-finite weights proposes nothing: train again")
    return cfg, state


def load_draft(path: str | Path, target):
    """A trained draft folder -> (algorithm, its module) on the target's device, sharing the
    target's embedding. The folder must have been trained for this target."""
    path = Path(path)
    cfg, state = read_draft(path)
    if cfg["target"]["sha256"] != target.content_hash:
        raise DraftsmithError(f"draft '{path}' was trained for {cfg['target']['name']} "
                              f"({cfg['target']['sha256'][:12]}), not {target.name} ({target.content_hash[:12]})")
    draft = build(cfg["algorithm"], cfg["draft"], target)
    draft.load_state_dict(state, strict=True)
    return cfg["algorithm"], draft.to(target.device, target.dtype)

"""Trained draft folder -> a folder vLLM loads with `--speculative-config`, and back.

Generic over algorithms: each has one exporter module under export/, registered in
`EXPORTERS` under the same name as its draft in trainer.drafts.DRAFTS. An exporter
provides METHOD (vLLM's speculative method), TITLE, FORMATS, FP8_FORMATS, `tensors(d)` (our
names for draft config d), `key_map(fmt, d)` (ours -> the file's, one to one),
`config_json(...)`, `keep_bf16(quantize_fc)` (what Quark must leave BF16, with vLLM's
runtime names), `probe(...)` (the constant-proposal probe) and `describe(manifest)`.

Each export folder also holds draftsmith_export.json (what was exported from what,
sha256 of every file) and the draft's training report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from export import dflash, dspark, eagle3
from trainer.drafts import build
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json
from trainer.target import LAYER_ID_CONVENTION, sha256_file

EXPORT_MANIFEST = "draftsmith_export.json"
WEIGHTS = "model.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EXPORTERS = {"eagle3": eagle3, "dflash": dflash, "dspark": dspark}  # algorithm (trainer.drafts.DRAFTS key) -> its exporter


def exporter(algorithm: str):
    try:
        return EXPORTERS[algorithm]
    except KeyError:
        raise DraftsmithError(f"algorithm {algorithm!r} has no exporter (known: {', '.join(EXPORTERS)})") from None


def rename_strict(state: dict, mapping: dict[str, str], what: str) -> dict:
    """Apply a one-to-one key map; any key missing or left over is an error naming it."""
    missing = sorted(set(mapping) - set(state))
    extra = sorted(set(state) - set(mapping))
    if missing or extra:
        raise DraftsmithError(f"{what}: tensors do not match the key map (missing {missing or 'none'}, "
                              f"unexpected {extra or 'none'}); was it written by another version?")
    return {mapping[k]: v for k, v in state.items()}


def read_draft_dir(path: str | Path) -> tuple[dict, dict]:
    """A recipes/train.py output -> (its config.json, its tensors by our names), checked."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, weights = path / "config.json", path / WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise DraftsmithError(f"'{path}' is not a trained draft folder (needs config.json and {WEIGHTS}); "
                              "pass the output_dir of recipes/train.py")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as err:
        raise DraftsmithError(f"{cfg_path} is not valid JSON ({err}); train again or restore it") from None
    if (path / EXPORT_MANIFEST).is_file() or "architectures" in cfg:
        raise DraftsmithError(f"'{path}' is already an export; export the trained draft folder it came from")
    if cfg.get("algorithm") not in EXPORTERS:
        raise DraftsmithError(f"{cfg_path}: algorithm {cfg.get('algorithm')!r} has no exporter "
                              f"(known: {', '.join(EXPORTERS)})")
    from trainer.drafts import check_draft_dir

    check_draft_dir(path, cfg)
    try:
        state = load_file(weights)
    except Exception as err:  # safetensors' own error types for a damaged file
        raise DraftsmithError(f"{weights} is not readable safetensors ({err}); train again") from None
    ours = {k: k for k in exporter(cfg["algorithm"]).tensors(cfg["draft"])}
    rename_strict(state, ours, str(weights))
    check_shapes(cfg, state, str(weights))
    return cfg, state


def check_shapes(cfg: dict, state: dict, what: str) -> None:
    """Every tensor has the shape the draft config says (an edited config.json, e.g. other
    aux layer ids, would export a config vLLM misreads): the module built from the config on
    the meta device, compared name by name."""
    from trainer.drafts import get

    algo = get(cfg["algorithm"])
    try:
        with torch.device("meta"):
            module = algo.Draft(algo.Config(**cfg["draft"]))
    except (TypeError, ValueError, DraftsmithError) as err:
        raise DraftsmithError(f"{what}: its config.json 'draft' section does not build a {cfg['algorithm']} "
                              f"draft ({err})") from None
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    bad = [f"{k} {tuple(v.shape)} (config says {want[k]})" for k, v in state.items()
           if k in want and tuple(v.shape) != want[k]]
    if bad:
        raise DraftsmithError(f"{what}: tensors do not fit the draft config: {'; '.join(bad[:3])}; the config or "
                              "the weights were changed after training")


def check_against_target(cfg: dict, target, draft_dir: Path) -> None:
    """Refuse a draft whose training inputs disagree with the named target."""
    t, d = cfg["target"], cfg["draft"]
    problems = []
    if t["sha256"] != target.content_hash:
        problems.append(f"weights sha256 {t['sha256'][:12]} != {target.content_hash[:12]}")
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_layers", target.num_layers)):
        if t[key] != have:
            problems.append(f"{key} {t[key]} != {have}")
    if d["target_hidden_size"] != target.hidden_size or d["vocab_size"] != target.vocab_size:
        problems.append("the draft's target_hidden_size/vocab_size do not match")
    if any(not 0 <= i <= target.num_layers for i in d["aux_layer_ids"]):
        problems.append(f"aux layer ids {d['aux_layer_ids']} out of range for {target.num_layers} layers")
    capture = cfg.get("data", {}).get("capture")
    manifest = Path(capture) / "manifest.json" if capture else None
    if manifest is not None and manifest.is_file():  # the training data's own record, when still on disk
        from trainer.data.shards import load_manifest

        m = load_manifest(capture).manifest
        if not set(d["aux_layer_ids"]) <= set(m["aux_layer_ids"]):
            problems.append(f"capture {capture} holds layer ids {m['aux_layer_ids']}, the draft says it was trained "
                            f"on {d['aux_layer_ids']}")
        if m["target"]["sha256"] != target.content_hash:
            problems.append(f"capture {capture} was made from another target ({m['target']['name']})")
    if problems:
        raise DraftsmithError(f"draft '{draft_dir}' was trained for {t['name']}, which disagrees with target "
                              f"'{target.name}': {'; '.join(problems)}. Export it with the target it was trained on")


def serve_command(target_ref: str, export_dir: str, num_draft_tokens: int, method: str) -> str:
    spec = json.dumps({"method": method, "model": str(export_dir), "num_speculative_tokens": num_draft_tokens})
    return f"vllm serve {target_ref} --speculative-config '{spec}'"


def write_export(out: Path, cfg: dict, state: dict, target, fmt: str, dtype: str, num_draft_tokens: int,
                 draft_dir: Path, extra: dict | None = None) -> dict:
    """Write config.json + model.safetensors + draftsmith_export.json into `out` (a fresh temp dir)."""
    from trainer.io import atomic_save_safetensors

    ex = exporter(cfg["algorithm"])
    if fmt not in ex.FORMATS:
        raise DraftsmithError(f"format '{fmt}' is not one of {', '.join(ex.FORMATS)} for {cfg['algorithm']}")
    torch_dtype = DTYPES[dtype]
    tensors = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous()
               for k, v in rename_strict(state, ex.key_map(fmt, cfg["draft"]), "draft").items()}
    atomic_save_safetensors(out / WEIGHTS, tensors, metadata={"format": "pt"})
    atomic_write_json(out / "config.json", ex.config_json(cfg["draft"], target, fmt, dtype, num_draft_tokens))
    for name in ("train_report.json",):
        if (draft_dir / name).is_file():
            shutil.copyfile(draft_dir / name, out / name)
    return write_manifest(out, {
        "format": fmt, "algorithm": cfg["algorithm"], "method": ex.METHOD, "dtype": dtype, "quantization": None,
        "source": {"draft_dir": str(draft_dir), "sha256": sha256_file(draft_dir / WEIGHTS)},
        "target": {"name": target.name, "sha256": target.content_hash, "hf_dir": target.hf_dir,
                   "license": target.license,
                   "num_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size},
        "draft": cfg["draft"], "data": cfg.get("data"), "layer_id_convention": LAYER_ID_CONVENTION,
        "num_draft_tokens": num_draft_tokens, **(extra or {})})


def write_manifest(out: Path, body: dict) -> dict:
    """draftsmith_export.json, last: it lists the sha256 and size of every other file."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != EXPORT_MANIFEST}
    manifest = {**body, "files": files}
    atomic_write_json(out / EXPORT_MANIFEST, manifest)
    return manifest


def read_export(path: str | Path) -> tuple[dict, dict, dict]:
    """An export folder -> (draftsmith_export.json, config.json, tensors in the file's names)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / EXPORT_MANIFEST).is_file():
        raise DraftsmithError(f"'{path}' is not a draftsmith export (no {EXPORT_MANIFEST}); "
                              "create one with `draftsmith export`")
    try:
        manifest = json.loads((path / EXPORT_MANIFEST).read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise DraftsmithError(f"{path / EXPORT_MANIFEST} is not a complete export manifest; export again") from None
    for name, info in files.items():
        p = path / name
        if not p.is_file():
            raise DraftsmithError(f"export '{path}' is incomplete: {name} is missing; export again")
        if p.stat().st_size != info["bytes"] or sha256_file(p) != info["sha256"]:
            raise DraftsmithError(f"export '{path}': {name} does not match its sha256 in {EXPORT_MANIFEST} "
                                  "(changed after export); export again")
    return manifest, json.loads((path / "config.json").read_text()), load_file(path / WEIGHTS)


def record_added_files(export_dir: Path, paths: list[Path]) -> None:
    """Record files written into an export after it was made (`draftsmith eval --output-dir
    EXPORT/eval`) in its manifest's `added_files`, with size and sha256: upload builds the
    model card only from reports recorded there, and refuses unrecorded files."""
    export_dir = Path(export_dir)
    manifest = json.loads((export_dir / EXPORT_MANIFEST).read_text())
    added = manifest.setdefault("added_files", {})
    for p in paths:
        added[Path(p).relative_to(export_dir).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    atomic_write_json(export_dir / EXPORT_MANIFEST, manifest)


def dequantize_fp8(state: dict) -> tuple[dict, set[str]]:
    """Quark FP8 tensors (`W.weight` e4m3 + `W.weight_scale`) -> float weights, and the set
    of quantized layer names. weight = fp8 * scale, per output channel ([O, 1]) or per tensor."""
    out, quantized = {}, set()
    for key, value in state.items():
        if key.endswith(".weight_scale") or key.endswith(".input_scale"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            layer = key.removesuffix(".weight")
            scale = state.get(f"{layer}.weight_scale")
            if scale is None:
                raise DraftsmithError(f"FP8 tensor {key} has no {layer}.weight_scale")
            out[key] = value.to(torch.float32) * scale.to(torch.float32).reshape(-1, *([1] * (value.dim() - 1)))
            quantized.add(layer)
        else:
            out[key] = value
    return out, quantized


class FP8DynamicLinear(torch.nn.Module):
    """What vLLM computes for a `ptpc_fp8` layer: the FP8 weight (already dequantized
    here) times the input rounded to FP8 with a dynamic per-token scale amax/448
    (vllm/model_executor/layers/quantization/utils/fp8_utils.py; OCP E4M3 max = 448)."""

    def __init__(self, linear: torch.nn.Linear, static_input_scale: torch.Tensor | None = None):
        super().__init__()
        self.linear = linear
        self.static_input_scale = static_input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        finfo = torch.finfo(torch.float8_e4m3fn)
        if self.static_input_scale is None:
            scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / finfo.max  # [..., 1]
        else:
            scale = self.static_input_scale.float()
        xq = (x.float() / scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn).float() * scale
        return self.linear(xq.to(x.dtype))


def load_export(path: str | Path, target):
    """Rebuild the draft from an export (BF16 or FP8) for the in-tree decoder: strict names,
    FP8 weights dequantized and FP8 activation rounding simulated, on the target's device.
    Returns (algorithm, draft module)."""
    manifest, _, state = read_export(path)
    if manifest["target"]["sha256"] != target.content_hash:
        raise DraftsmithError(f"export '{path}' is for {manifest['target']['name']} "
                              f"({manifest['target']['sha256'][:12]}), not {target.name} ({target.content_hash[:12]})")
    quant = manifest.get("quantization") or {}
    state, quantized = dequantize_fp8(state) if quant else (state, set())
    inverse = {v: k for k, v in exporter(manifest["algorithm"]).key_map(manifest["format"], manifest["draft"]).items()}
    state = rename_strict(state, inverse, f"{path}/{WEIGHTS}")
    draft = build(manifest["algorithm"], manifest["draft"], target)
    draft.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()},
                          strict=True)
    for layer in sorted(quantized):
        ours = inverse[f"{layer}.weight"].removesuffix(".weight")
        parent_name, _, child = ours.rpartition(".")
        parent = draft.get_submodule(parent_name) if parent_name else draft
        setattr(parent, child, FP8DynamicLinear(getattr(parent, child)))
    return manifest["algorithm"], draft.to(target.device, target.dtype)


def draft_state_from_export(path: str | Path) -> dict:
    """The tensors of a BF16/FP32 export under our names (for round-trip checks)."""
    manifest, _, state = read_export(path)
    inverse = {v: k for k, v in exporter(manifest["algorithm"]).key_map(manifest["format"], manifest["draft"]).items()}
    return rename_strict(state, inverse, f"{path}/{WEIGHTS}")

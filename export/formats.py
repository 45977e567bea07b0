"""Trained draft folder -> a folder vLLM loads with `--speculative-config`, and back.

Generic over algorithms: each has one exporter module under export/, registered in
`EXPORTERS` under the same name as its draft in trainer.drafts.registry.DRAFTS. An exporter
provides METHOD (vLLM's speculative method), TITLE, FORMATS, FP8_FORMATS, OPTIONS (proposer
options it writes into config.json, by vLLM's key), `key_map(fmt, names)` (our names -> the
file's, one to one; our names are the draft module's state-dict keys, `tensor_names`),
`config_json(d, target, fmt, dtype, num_draft_tokens, options)`, `keep_bf16(d, quantize_fc,
quantize_qkv)` (what Quark must leave BF16, with vLLM's runtime names) and `describe(manifest)`.

Each export folder also holds draftsmith_export.json (what was exported from what,
sha256 of every file) and the draft's training report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from export import dflash, dspark, eagle3, fp8_reload
from trainer.data.shards import load_manifest
from trainer.drafts.folder import check_finite_weights, module_shapes, read_draft
from trainer.drafts.registry import build, get
from trainer.errors import DraftsmithError
from trainer.io import atomic_save_safetensors, atomic_write_json, sha256_file
from trainer.layer_ids import LAYER_ID_CONVENTION
from trainer.speculative import check_num_draft_tokens

EXPORT_MANIFEST = "draftsmith_export.json"
WEIGHTS = "model.safetensors"
EXPORT_AGAIN = ("a draft of non-finite weights proposes nothing: export again from a trained draft whose weights are "
                "finite")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# algorithm (a key of trainer.drafts.registry.DRAFTS) -> its exporter
EXPORTERS = {"eagle3": eagle3, "dflash": dflash, "dspark": dspark}


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


def tensor_names(algorithm: str, draft_cfg: dict) -> list[str]:
    """Our names of a draft's tensors for `draft_cfg`: the state-dict keys of the module it
    builds (on the meta device). Every one is exported, nothing else is."""
    return list(module_shapes(algorithm, draft_cfg))


def key_map(algorithm: str, fmt: str, draft_cfg: dict) -> dict[str, str]:
    """Our name -> the name in `fmt`'s file, for every tensor of `draft_cfg`."""
    return exporter(algorithm).key_map(fmt, tensor_names(algorithm, draft_cfg))


def read_draft_dir(path: str | Path) -> tuple[dict, dict]:
    """A recipes/train.py output -> (its config.json, its tensors by our names), checked
    (trainer/drafts/folder.py), and not an export."""
    path = Path(path)
    if (path / EXPORT_MANIFEST).is_file():
        raise DraftsmithError(f"'{path}' is already an export; export the trained draft folder it came from")
    cfg, state = read_draft(path)
    exporter(cfg["algorithm"])
    return cfg, state


def check_against_target(cfg: dict, target, draft_dir: Path) -> None:
    """Refuse a draft whose training inputs disagree with the named target."""
    trained_for, draft_cfg = cfg["target"], cfg["draft"]
    problems = []
    if trained_for["sha256"] != target.content_hash:
        problems.append(f"weights sha256 {trained_for['sha256'][:12]} != {target.content_hash[:12]}")
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_layers", target.num_layers)):
        if trained_for[key] != have:
            problems.append(f"{key} {trained_for[key]} != {have}")
    if draft_cfg["target_hidden_size"] != target.hidden_size or draft_cfg["vocab_size"] != target.vocab_size:
        problems.append("the draft's target_hidden_size/vocab_size do not match")
    if any(not 0 <= i <= target.num_layers for i in draft_cfg["aux_layer_ids"]):
        problems.append(f"aux layer ids {draft_cfg['aux_layer_ids']} out of range for {target.num_layers} layers")
    capture = cfg.get("data", {}).get("capture")
    manifest = Path(capture) / "manifest.json" if capture else None
    if manifest is not None and manifest.is_file():  # the training data's own record, when still on disk
        manifest = load_manifest(capture).manifest
        if not set(draft_cfg["aux_layer_ids"]) <= set(manifest["aux_layer_ids"]):
            problems.append(f"capture {capture} holds layer ids {manifest['aux_layer_ids']}, the draft says it was "
                            f"trained on {draft_cfg['aux_layer_ids']}")
        if manifest["target"]["sha256"] != target.content_hash:
            problems.append(f"capture {capture} was made from another target ({manifest['target']['name']})")
    if problems:
        raise DraftsmithError(f"draft '{draft_dir}' was trained for {trained_for['name']}, which disagrees with target "
                              f"'{target.name}': {'; '.join(problems)}. Export it with the target it was trained on")


def serve_command(target_ref: str, export_dir: str, num_draft_tokens: int, method: str,
                  max_model_len: int | None = None) -> str:
    """The `vllm serve` line; `max_model_len` where the target needs one named (a LongRoPE target:
    trainer.families.serve_max_model_len)."""
    spec = json.dumps({"method": method, "model": str(export_dir), "num_speculative_tokens": num_draft_tokens})
    length = f" --max-model-len {max_model_len}" if max_model_len else ""
    return f"vllm serve {target_ref}{length} --speculative-config '{spec}'"


def check_export_options(algorithm: str, fmt: str, quantize: str, num_draft_tokens: int, draft_cfg: dict,
                         options: dict) -> None:
    """What an export is asked for must be what the algorithm can write and serve: its formats
    (FP8 ones under quantize=fp8), N within what the draft proposes, options vLLM reads."""
    ex = exporter(algorithm)
    allowed = ex.FP8_FORMATS if quantize == "fp8" else ex.FORMATS
    if fmt not in allowed:
        raise DraftsmithError(f"format '{fmt}'{' with quantize=fp8' if quantize == 'fp8' else ''} is not written for "
                              f"{algorithm}; use one of {', '.join(allowed)}")
    most = get(algorithm).Config(**draft_cfg).max_draft_tokens
    check_num_draft_tokens(num_draft_tokens, most, f"a {algorithm} draft of this shape")
    unknown = sorted(set(options) - set(ex.OPTIONS))
    if unknown:
        raise DraftsmithError(f"draft option(s) {', '.join(unknown)} cannot be served by vLLM for {algorithm}; it "
                              f"reads {', '.join(ex.OPTIONS) or 'none'}")


def write_export(out: Path, cfg: dict, state: dict, target, fmt: str, dtype: str, num_draft_tokens: int,
                 draft_dir: Path, extra: dict | None = None, options: dict | None = None) -> dict:
    """Write config.json + model.safetensors + draftsmith_export.json into `out` (a fresh temp dir)."""
    ex = exporter(cfg["algorithm"])
    options = dict(options or {})
    check_export_options(cfg["algorithm"], fmt, "none", num_draft_tokens, cfg["draft"], options)
    torch_dtype = DTYPES[dtype]
    tensors = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous()
               for k, v in rename_strict(state, key_map(cfg["algorithm"], fmt, cfg["draft"]), "draft").items()}
    atomic_save_safetensors(out / WEIGHTS, tensors, metadata={"format": "pt"})
    atomic_write_json(out / "config.json", ex.config_json(cfg["draft"], target, fmt, dtype, num_draft_tokens, options))
    for name in ("train_report.json",):
        if (draft_dir / name).is_file():
            shutil.copyfile(draft_dir / name, out / name)
    return write_manifest(out, {
        "format": fmt, "algorithm": cfg["algorithm"], "method": ex.METHOD, "dtype": dtype, "quantization": None,
        "source": {"draft_dir": str(draft_dir), "sha256": sha256_file(draft_dir / WEIGHTS)},
        "target": {"name": target.name, "spec": target.spec, "sha256": target.content_hash, "hf_dir": target.hf_dir,
                   "license": target.license,
                   "num_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size},
        "draft": cfg["draft"], "data": cfg.get("data"), "layer_id_convention": LAYER_ID_CONVENTION,
        "num_draft_tokens": num_draft_tokens, "draft_options": options, **(extra or {})})


def write_manifest(out: Path, body: dict) -> dict:
    """draftsmith_export.json, last: it lists the sha256 and size of every other file."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != EXPORT_MANIFEST}
    manifest = {**body, "files": files}
    atomic_write_json(out / EXPORT_MANIFEST, manifest)
    return manifest


def read_export(path: str | Path) -> tuple[dict, dict, dict]:
    """An export folder -> (draftsmith_export.json, config.json, tensors in the file's names)."""
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
    state = load_file(path / WEIGHTS)
    check_finite_weights(state, path / WEIGHTS, EXPORT_AGAIN)
    return manifest, json.loads((path / "config.json").read_text()), state


def check_export_weights(path: str | Path) -> None:
    """An export's weights hold no inf/NaN (read tensor by tensor: one in memory at a time)."""
    f = Path(path) / WEIGHTS
    try:
        st = safe_open(f, "pt")
    except Exception as err:  # safetensors' own error types for a damaged file
        raise DraftsmithError(f"{f} is not readable safetensors ({err}); export again") from None
    with st:
        check_finite_weights(((k, st.get_tensor(k)) for k in st.keys()), f, EXPORT_AGAIN)


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


def load_export(path: str | Path, target):
    """Rebuild the draft from an export (BF16 or FP8) for the in-tree decoder: strict names,
    FP8 weights dequantized and FP8 activation rounding simulated, on the target's device.
    Returns (algorithm, draft module)."""
    manifest, _, state = read_export(path)
    if manifest["target"]["sha256"] != target.content_hash:
        raise DraftsmithError(f"export '{path}' is for {manifest['target']['name']} "
                              f"({manifest['target']['sha256'][:12]}), not {target.name} ({target.content_hash[:12]})")
    quant = manifest.get("quantization") or {}
    state, quantized = fp8_reload.dequantize_fp8(state) if quant else (state, set())
    inverse = {v: k for k, v in key_map(manifest["algorithm"], manifest["format"], manifest["draft"]).items()}
    state = rename_strict(state, inverse, f"{path}/{WEIGHTS}")
    draft = build(manifest["algorithm"], manifest["draft"], target)
    draft.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()},
                          strict=True)
    fp8_reload.simulate_fp8(draft, {inverse[f"{layer}.weight"].removesuffix(".weight") for layer in quantized})
    return manifest["algorithm"], draft.to(target.device, target.dtype)


def draft_state_from_export(path: str | Path) -> dict:
    """The tensors of a BF16/FP32 export under our names (for round-trip checks)."""
    manifest, _, state = read_export(path)
    inverse = {v: k for k, v in key_map(manifest["algorithm"], manifest["format"], manifest["draft"]).items()}
    return rename_strict(state, inverse, f"{path}/{WEIGHTS}")

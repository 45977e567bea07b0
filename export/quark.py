"""FP8 drafts with AMD Quark, in the layout vLLM's `quark` loader reads.

Flow: Quark's file-to-file mode (`ModelQuantizer.direct_quantize_checkpoint`) on the
BF16 vLLM export, then post-processing of its config. This is how AMD made its
Kimi-K2.5 EAGLE-3 FP8 draft; it needs no transformers `PreTrainedModel` (Quark's
`export_safetensors` does), so the draft is not wrapped: its safetensors are
quantized tensor by tensor and `quantization_config` is fixed up afterwards.

Scheme `ptpc_fp8`: FP8 E4M3 weights with one static scale per output channel,
activations FP8 with a dynamic per-token scale. No calibration, and the only FP8
layout vLLM's CPU build loads. Static per-tensor `fp8` (activations calibrated)
needs Quark's model flow and is not offered here yet.

What stays BF16 is the algorithm exporter's call (`keep_bf16`: e.g. EAGLE-3's `lm_head`,
which vLLM never quantizes under `quark`, and `fc` unless asked, as AMD's shipped draft
kept it); embeddings are not exported and norms are not Linear. vLLM fuses q/k/v and
gate/up, so those groups are never split.

The pitfall this module exists for: Quark matches `exclude` on its own module names
and writes back the exact names it matched ("fc", "lm_head"). vLLM matches `exclude`
against runtime names ("model.fc", "model.layers.30.self_attn.qkv_proj") exactly, or
as `re:` regexes (vllm/model_executor/layers/quantization/quark/utils.py,
should_ignore_layer). Unrewritten, an excluded `fc` is built as an FP8 layer whose
scale is never loaded and outputs garbage without an error. `rewrite_exclude`
replaces the list with anchored `re:` patterns.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json

QUARK_VERSION = "0.13"  # pinned in pyproject.toml; file-to-file and the exclude semantics checked against it
SCHEMES = ("ptpc_fp8",)


def vllm_exclude(runtime_names: list[str]) -> list[str]:
    """vLLM runtime names of the layers kept BF16 (the exporter's `keep_bf16` values, e.g.
    EAGLE-3's `fc` runs as `model.fc`) -> anchored `re:` patterns. A draft layer index is
    generalized (`layers.N.` -> any N): vLLM builds draft layers after the target's
    (model.layers.{L_target + i}) and every draft layer is treated alike. For a fused
    layer vLLM matches each shard's name (q_proj, k_proj, v_proj of qkv_proj:
    quark/utils.py should_ignore_layer), so q/k/v are kept together."""
    out = []
    for name in runtime_names:
        pattern = re.sub(r"layers\\\.\d+\\\.", r"layers\\.\\d+\\.", re.escape(name))
        out.append(f"re:^(.*\\.)?{pattern}$")
    return sorted(set(out))


def quantization_scheme(scheme: str):
    """Quark's QConfig pieces for `scheme`, built from its spec helpers (quark 0.13 names).
    Quark is imported here, not at the top: its first import compiles an extension (30-70 s)."""
    from quark.torch.quantization.config.config import FP8E4M3PerChannelSpec, QLayerConfig

    if scheme != "ptpc_fp8":
        raise DraftsmithError(f"FP8 scheme '{scheme}' is not supported; use one of {', '.join(SCHEMES)}")
    weight = FP8E4M3PerChannelSpec(is_dynamic=False, ch_axis=0).to_quantization_spec()  # one scale per out channel
    tokens = FP8E4M3PerChannelSpec(is_dynamic=True, ch_axis=1).to_quantization_spec()  # one scale per token
    return QLayerConfig(weight=weight, input_tensors=tokens)


def quantize_fp8(bf16_dir: Path, out_dir: Path, keep_bf16: dict[str, str], scheme: str = "ptpc_fp8") -> dict:
    """Quantize the BF16 vLLM export in `bf16_dir` into `out_dir` (which Quark recreates),
    leaving the layers named in `keep_bf16` ({Quark name: vLLM runtime name}) in BF16.
    Returns the final quantization_config."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")  # torch.compile in freeze is useless on the CPU
    os.environ.setdefault("QUARK_LOG_LEVEL", "warning")  # its info lines print the whole QConfig
    try:
        from quark.torch import ModelQuantizer
        from quark.torch.quantization.config.config import QConfig
    except ImportError as err:
        raise DraftsmithError(f"--quantize fp8 needs AMD Quark: pip install amd-quark=={QUARK_VERSION} "
                              f"({err})") from None
    excluded = sorted(keep_bf16)
    config = QConfig(global_quant_config=quantization_scheme(scheme), exclude=excluded)
    ModelQuantizer(config).direct_quantize_checkpoint(str(bf16_dir), str(out_dir), device="cpu")
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qcfg = cfg.get("quantization_config")
    if not qcfg or qcfg.get("quant_method") != "quark" or "export" not in qcfg:
        raise DraftsmithError(f"Quark wrote no usable quantization_config into {cfg_path} "
                              "(vLLM needs quant_method 'quark' and an 'export' section)")
    qcfg["exclude"] = rewrite_exclude(qcfg.get("exclude", []), keep_bf16)
    unmatched = [rt for rt in keep_bf16.values() if not any(re.fullmatch(p[3:], rt) for p in qcfg["exclude"])]
    if unmatched:  # the patterns must match what vLLM will call these layers
        raise DraftsmithError(f"the rewritten exclude {qcfg['exclude']} does not match vLLM runtime names {unmatched}")
    atomic_write_json(cfg_path, cfg)
    return qcfg


def rewrite_exclude(written: list[str], asked: dict[str, str]) -> list[str]:
    """Quark's exact-name `exclude` -> vLLM `re:` patterns of the runtime names. Every name
    we asked to keep in BF16 must be there (Quark drops `re:` entries and names that
    matched nothing)."""
    plain = [n for n in written if not n.startswith("re:")]
    missing = sorted(set(asked) - set(plain))
    if missing:
        raise DraftsmithError(f"Quark did not record {missing} as excluded; refusing to write an FP8 draft "
                              "whose BF16 layers vLLM would build as FP8")
    return vllm_exclude(sorted(set(asked.values())))

"""An FP8 export reloaded in-tree as vLLM computes it: Quark's FP8 weights dequantized, and
every quantized Linear's input rounded to FP8 with a dynamic per-token scale (ptpc_fp8).
What the FP8 gate and `draftsmith eval` of an FP8 export measure."""

from __future__ import annotations

import torch

from trainer.errors import DraftsmithError


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

    @property
    def weight(self) -> torch.Tensor:  # callers that read a Linear's weight (a dtype, a device) still can
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        finfo = torch.finfo(torch.float8_e4m3fn)
        if self.static_input_scale is None:
            scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / finfo.max  # [..., 1]
        else:
            scale = self.static_input_scale.float()
        xq = (x.float() / scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn).float() * scale
        return self.linear(xq.to(x.dtype))


def simulate_fp8(draft: torch.nn.Module, layers: set[str]) -> None:
    """Wrap each named Linear of `draft` (our module names) in FP8DynamicLinear, in place."""
    for name in sorted(layers):
        parent_name, _, child = name.rpartition(".")
        parent = draft.get_submodule(parent_name) if parent_name else draft
        setattr(parent, child, FP8DynamicLinear(getattr(parent, child)))

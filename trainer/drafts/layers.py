"""Layers every draft shares, written once: RMSNorm, rotary embeddings, the SwiGLU MLP,
and attention over a key/value prefix.

Norm and MLP are transformers' Llama modules (the same numerics and parameter names
as the target and as vLLM's loaders expect); rotary uses transformers' RoPE init
functions, so llama3/yarn scaling matches what vLLM builds from the same config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def RMSNorm(size: int, eps: float) -> nn.Module:  # noqa: N802 (a module factory)
    """Llama's RMSNorm (Zhang & Sennrich 2019), computed in fp32 and cast back; parameter `weight`."""
    return LlamaRMSNorm(size, eps=eps)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); vLLM fuses gate/up into gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al., 2021), the half-rotation layout of Llama/Qwen. x [B, h, T, hd]; cos/sin [B, T, rd]:
    the first rd <= hd dims rotate (partial rotary, as Phi-3/GPT-NeoX and vLLM's get_rope with a
    rotary_dim do), the rest pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos[:, None] + rotate_half(x) * sin[:, None]
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos[:, None] + rotate_half(rot) * sin[:, None], rest], dim=-1)


class Rotary(nn.Module):
    """cos/sin tables for integer positions, from the target's `rope_parameters` (its
    `partial_rotary_factor` too: the first head_dim x factor dims rotate, vLLM's rotary_dim)."""

    def __init__(self, head_dim: int, rope_parameters: dict, max_position_embeddings: int, hidden_size: int,
                 num_attention_heads: int):
        super().__init__()
        hf = LlamaConfig(hidden_size=hidden_size, num_attention_heads=num_attention_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rope_parameters=dict(rope_parameters))
        rope_type = hf.rope_parameters.get("rope_type", "default")
        rotary_dim = int(head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
        # computed on the CPU whatever the default device is: a draft built on the meta device
        # (folder.py module_shapes) would otherwise have transformers' init copy a meta tensor
        with torch.device("cpu"):
            if rope_type == "default":
                base = hf.rope_parameters["rope_theta"]
                inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
                scale = 1.0
            else:  # transformers' init functions honour partial_rotary_factor themselves
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # not in the state dict: module.to() moves it
        self.scale = scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, rd]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None = None,
           causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention (PyTorch SDPA: runs on CPU, CUDA and ROCm) with GQA.
    q [B, nh, T, hd]; keys/values [B, nkv, S, hd] (a prefix of committed or context
    entries, then the new ones); allowed: bool [B, 1, T, S] or None. -> [B, nh, T, hd]."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, is_causal=causal and allowed is None,
                                          enable_gqa=q.shape[1] != keys.shape[1])

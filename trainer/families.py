"""A target's parts found by their role, one adapter for every family shape: the token embedding,
the decoder layers, the final norm, the LM head, what the family does to its logits, and the
config fields a draft takes under the names each family gives them. Everything draftsmith
computes from a target (its states, its logits, a draft's labels) goes through these, so a
family is handled once, here, or refused before any work in one line naming what it lacks.

Roles (transformers' own accessors first, then the attribute names the families use):
    embedding    get_input_embeddings()                       embed_tokens | embed_in | wte
    layers       the decoder's module list                    layers | h | blocks
    final norm   the norm on the last layer's output          norm | final_layer_norm | ln_f | norm_f
    head         get_output_embeddings()                      lm_head | embed_out

Logit transforms (what the family's own forward does after its head, and vLLM's logits
processor with it: granite.py, gemma2.py, cohere.py, minicpm.py): Granite divides by
`logits_scaling`; Gemma-2/3 soft-cap at `final_logit_softcapping`; Cohere multiplies by
`logit_scale`; MiniCPM divides by hidden_size / dim_model_base; HyperCLOVAX multiplies by
its `logits_scaling`; Falcon-H1 multiplies by `lm_head_multiplier`, MuseGlimmer by
`output_multiplier` before its soft-cap. Every full load checks the transform against the
family's own forward (`trainer.target.check_logits`): a family whose transform is not one of
these is refused in one line. Embedding, residual and attention multipliers (Granite, Gemma's
sqrt(H)) live inside the target's forward and so in its states; a draft embeds with the raw
embedding matrix, as vLLM shares it (trainer.target.Target.token_embedding).

LongRoPE (Phi-3.5, Phi-3-128k): vLLM uses the long factors at every position whenever the
served max_model_len exceeds `original_max_position_embeddings` (its default for these
models; vllm/model_executor/layers/rotary_embedding/phi3_long_rope_scaled_rope.py), where HF
switches by sequence length. draftsmith computes the target as vLLM serves it by default:
`as_served` sets the short factors to the long ones, for the target, its states, the draft
(trained and exported with that one set, so vLLM's choice cannot differ) and the in-tree
decoder alike; vLLM runners are given a max_model_len above the original length.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from trainer.errors import TargetError

EMBEDDING_NAMES = ("embed_tokens", "embed_in", "wte", "word_embeddings")
LAYER_NAMES = ("layers", "h", "blocks")
NORM_NAMES = ("norm", "final_layer_norm", "ln_f", "norm_f", "final_layernorm")
EPS_NAMES = ("rms_norm_eps", "norm_epsilon", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


@dataclass
class TargetParts:
    decoder: nn.Module  # the base model (embedding, layers, final norm)
    embedding: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module
    head: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]  # the family's transform of the head's output


def _named(module: nn.Module, names, what: str, model_type: str):
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise TargetError(f"target family '{model_type}': no {what} found (looked for {', '.join(names)} on "
                      f"{type(module).__name__}); draftsmith cannot train drafts for it")


def find_parts(model: nn.Module) -> TargetParts:
    """The target's parts by role, or one line naming the one that is missing."""
    cfg = model.config.get_text_config()
    kind = getattr(cfg, "model_type", type(model).__name__)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise TargetError(f"target family '{kind}': {type(model).__name__} has no decoder model inside (not a "
                          "causal LM with a base model); draftsmith cannot train drafts for it")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding = embedding if embedding is not None else _named(decoder, EMBEDDING_NAMES, "token embedding", kind)
    layers = _named(decoder, LAYER_NAMES, "decoder layers", kind)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise TargetError(f"target family '{kind}': its decoder layers are not a module list; draftsmith cannot "
                          "train drafts for it")
    norm = _named(decoder, NORM_NAMES, "final norm", kind)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise TargetError(f"target family '{kind}': {type(model).__name__} has no LM head; draftsmith cannot train "
                          "drafts for it")
    return TargetParts(decoder, embedding, layers, norm, head, logit_transform(cfg))


def embedding_name(config) -> str:
    """The attribute the family's base model holds its token embedding under (built on the meta
    device from the config: no weight read)."""
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise TargetError(f"target family '{config.model_type}': transformers builds no causal LM from its config "
                          f"({str(err).splitlines()[0]})") from None
    parts = find_parts(model)
    return next(name for name, module in parts.decoder.named_children() if module is parts.embedding)


def logit_transform(cfg) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the family's forward does to its head's output (the module docstring); identity for
    most families. `load_target` holds it to the family's own forward on every full load
    (`check_logits`), so a family read wrongly here is refused, never trained on."""
    family = getattr(cfg, "model_type", "")
    factor = 1.0
    if family in ("minicpm", "minicpm3"):  # hidden / (H / dim_model_base) before the head (modeling_minicpm3.py)
        base = getattr(cfg, "dim_model_base", None) or cfg.hidden_size
        factor /= cfg.hidden_size / base
    elif family == "hyperclovax":  # head(h) * logits_scaling (modeling_hyperclovax.py)
        factor *= getattr(cfg, "logits_scaling", None) or 1.0
    elif getattr(cfg, "logits_scaling", None):  # Granite and its kin: head(h) / logits_scaling
        factor /= cfg.logits_scaling
    for name in ("logit_scale",  # Cohere
                 "lm_head_multiplier",  # Falcon-H1
                 "output_multiplier"):  # MuseGlimmer, before its soft-cap (modeling_muse_glimmer.py)
        if getattr(cfg, name, None):
            factor *= getattr(cfg, name)
    softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma-2/3, MuseGlimmer

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if factor != 1.0:
            logits = logits * factor
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return transform


def norm_eps(cfg) -> float:
    """The target's norm epsilon, under whichever name its family gives it; 1e-5 (torch's
    LayerNorm default, what OLMo and OPT hard-code) where its config names none. A draft's norms
    are its own: the value only has to be the one its export writes."""
    for name in EPS_NAMES:
        value = getattr(cfg, name, None)
        if value is not None:
            return float(value)
    return 1e-5


def intermediate_size(cfg) -> int:
    """The target's MLP width (GPT-2 names it n_inner, None meaning 4 H)."""
    for name in ("intermediate_size", "n_inner", "ffn_hidden_size"):
        value = getattr(cfg, name, None)
        if value:
            return int(value)
    return 4 * cfg.hidden_size


ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)  # what the target's classes and a draft's rotary compute


def _field(cfg, name: str):
    """cfg.name; None where absent or per layer (transformers raises for those: Gemma-4)."""
    try:
        return getattr(cfg, name, None)
    except Exception:
        return None


def _key(raw: dict, *names: str) -> str:
    """The first of `names` that the raw config.json section `raw` holds; else the first."""
    return next((name for name in names if raw.get(name) is not None), names[0])


def check_rope(config, raw: dict, where: str) -> None:
    """Refuse, before any work, a target config whose RoPE cannot be computed: a rope_type
    transformers does not know (its classes raise KeyError when built, and a draft's rotary
    reads the same table, trainer/drafts/layers.py) and a rotary fraction outside (0, 1] or
    that rotates an odd number of dims (a draft's rotary would not fit its heads). `config`:
    the target's HF config; `raw`: its config.json as read (to name the key as the file does);
    `where`: the file, named in the one line."""
    text, section = config.get_text_config(), raw
    prefix = ""
    if isinstance(raw.get("text_config"), dict) and text is not config:
        section, prefix = raw["text_config"], "text_config."
    rope = _field(text, "rope_parameters") or {}
    rope_key = _key(section, "rope_parameters", "rope_scaling")
    per_type = rope if rope and all(isinstance(v, dict) for v in rope.values()) else {"": rope}
    for layer_type, params in per_type.items():
        if not isinstance(params, dict):
            continue
        at = f"{prefix}{rope_key}{'.' + layer_type if layer_type else ''}"
        written = section.get(rope_key)
        written = written.get(layer_type) if layer_type and isinstance(written, dict) else written
        legacy = isinstance(written, dict) and "type" in written and "rope_type" not in written  # rope_scaling.type
        field = "type" if legacy else "rope_type"
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise TargetError(f"{where}: {at}.{field} is {kind!r}, a RoPE transformers "
                              f"{transformers.__version__} does not know (known: {', '.join(ROPE_TYPES)}), so neither "
                              "the target nor a draft can be computed; correct it in the target's config.json (the "
                              "model's own, as published), or use a transformers that knows it")
    try:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    except Exception:  # absent, or per layer (transformers raises for Gemma-4's): only the range is checked
        head_dim = None
    top = next((name for name in ("partial_rotary_factor", "rotary_pct") if section.get(name) is not None), None)
    fractions = [(f"{prefix}{name}", _field(text, name)) for name in ("partial_rotary_factor", "rotary_pct")]
    fractions += [(f"{prefix}{top}" if top else f"{prefix}{rope_key}{'.' + t if t else ''}.partial_rotary_factor",
                   p.get("partial_rotary_factor")) for t, p in per_type.items() if isinstance(p, dict)]
    for at, factor in fractions:
        if factor is None:
            continue
        number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        dims = int(head_dim * factor) if number and head_dim else None
        if not number or not 0 < factor <= 1 or (dims is not None and (dims < 2 or dims % 2)):
            rotated = f" (head_dim {head_dim} x {factor!r} = {head_dim * factor:g})" if dims is not None else ""
            raise TargetError(f"{where}: {at} is {factor!r}, but a rotary fraction must be above 0 and at most 1 and "
                              f"rotate an even number of each head's dims{rotated}; correct it in the target's "
                              "config.json (the model's own, as published)")


def is_longrope(cfg) -> bool:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return isinstance(rope, dict) and rope.get("rope_type") == "longrope"


def as_served(config):
    """The target's config as vLLM serves it by default (the module docstring): a LongRoPE target's
    short factors replaced by its long ones. Other configs are returned as they are."""
    text = config.get_text_config()
    if not is_longrope(text):
        return config
    config = copy.deepcopy(config)
    rope = config.get_text_config().rope_parameters
    rope["short_factor"] = list(rope["long_factor"])
    return config


def served_max_model_len(cfg, needed: int) -> int:
    """The max_model_len a vLLM runner gets: what it needs, and for a LongRoPE target above the
    original length, so that vLLM uses the long factors as draftsmith does."""
    if is_longrope(cfg):
        return max(needed, int(cfg.rope_parameters["original_max_position_embeddings"]) + 1)
    return needed


def longrope_note(cfg, stage: str) -> str | None:
    """For a LongRoPE target, one line saying what vLLM will do and what draftsmith does to match
    it (the module docstring); None for every other target."""
    if not is_longrope(cfg):
        return None
    original = int(cfg.rope_parameters["original_max_position_embeddings"])
    return (f"note: {stage}: this target uses LongRoPE: vLLM serves it with the long RoPE factors at every position "
            f"whenever --max-model-len exceeds {original} (its default, {int(cfg.max_position_embeddings)}), where "
            f"transformers uses them only past {original} tokens; draftsmith computes the target, its states, the "
            f"draft and its measurements with the long factors throughout, and the export's serve line names "
            f"--max-model-len {serve_max_model_len(cfg)}")


def serve_max_model_len(cfg) -> int | None:
    """The --max-model-len a serve line names: for a LongRoPE target, its full length (vLLM's
    default, and above the original length: the long factors draftsmith trained with); None for
    every other target (vLLM's default is right)."""
    if not is_longrope(cfg):
        return None
    return served_max_model_len(cfg, int(cfg.max_position_embeddings))

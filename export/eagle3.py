"""The EAGLE-3 exporter: file layouts, config.json, what stays BF16 under Quark.

Two layouts, both read by vLLM 0.32 (vllm/model_executor/models/llama_eagle3.py,
vllm/transformers_utils/configs/speculators/):

    "vllm"         config.json: architectures ["LlamaForCausalLMEagle3"], a one-layer Llama
                   config of the draft layer + target_hidden_size, draft_vocab_size,
                   eagle_aux_hidden_state_layer_ids (top level, "entering layer i" ids),
                   norm_before_residual (written: the native loader defaults it to False),
                   norm_before_fc and norm_output (written: both default to False).
                   Weights keep our names: fc, midlayer.*, norm, lm_head, d2t, t2d.
    "speculators"  config.json: speculators_model_type "eagle3", transformer_layer_config,
                   speculators_config {algorithm, proposal_methods, default_proposal_method,
                   verifier}; norm_before_residual written (this loader defaults it to True).
                   Weights: midlayer.* -> layers.0.*; `vllm serve DIR` alone works.

The target's embedding is never exported: the draft shares it (vLLM then uses the target's).
"""

from __future__ import annotations

from trainer.drafts.registry import VLLM_METHOD
from trainer.drafts.shape import flat_rope
from trainer.errors import DraftsmithError

METHOD = VLLM_METHOD["eagle3"]  # vLLM's speculative-config method
FORMATS = ("vllm", "speculators")
FP8_FORMATS = ("vllm",)  # Quark's file-to-file flow writes the vLLM-native names

OPTIONS: dict[str, str] = {}  # proposer options written into config.json (none for EAGLE-3)
# Layers an FP8 export keeps in BF16, by their names in the vLLM-native file (which are
# Quark's module names), with the vLLM runtime name each runs under: vLLM builds the draft
# at `model.` (fc -> model.fc) and leaves lm_head at the top (llama_eagle3.py). vLLM never
# quantizes lm_head under quark; fc stays BF16 unless asked (AMD's shipped drafts keep it).
KEEP_BF16 = {"lm_head": "lm_head"}
KEEP_BF16_UNLESS_ASKED = {"fc": "model.fc"}


def key_map(fmt: str, names: list[str]) -> dict[str, str]:
    """Our names (the draft module's state-dict keys) -> the names in `fmt`'s safetensors, one to one."""
    if fmt == "vllm":
        return {k: k for k in names}
    if fmt == "speculators":
        return {k: k.replace("midlayer.", "layers.0.", 1) for k in names}
    raise DraftsmithError(f"unknown EAGLE-3 export format '{fmt}'; use one of {', '.join(FORMATS)}")


def keep_bf16(draft: dict, quantize_fc: bool = False, quantize_qkv: bool = True) -> dict[str, str]:
    """{file/Quark name: vLLM runtime name} of the layers that stay BF16 in an FP8 export.
    The draft layer runs as model.layers.{L_target} (any index: export/quark.py generalizes it)."""
    keep = {**KEEP_BF16, **({} if quantize_fc else KEEP_BF16_UNLESS_ASKED)}
    if not quantize_qkv:  # together or not at all: vLLM fuses them into qkv_proj
        keep.update({f"midlayer.self_attn.{p}_proj": f"model.layers.0.self_attn.{p}_proj" for p in "qkv"})
    return keep


def llama_layer_config(draft: dict, target, dtype: str) -> dict:
    """The one-layer Llama config of the draft layer, as vLLM builds it (LlamaDecoderLayer fields)."""
    tcfg = target.model.config.get_text_config()
    rope = flat_rope(draft["rope_parameters"])  # one flat dict, whatever the target's layer types
    return {
        "model_type": "llama",
        "hidden_size": draft["hidden_size"], "intermediate_size": draft["intermediate_size"],
        "num_attention_heads": draft["num_attention_heads"], "num_key_value_heads": draft["num_key_value_heads"],
        "head_dim": draft["head_dim"], "hidden_act": "silu", "rms_norm_eps": draft["rms_norm_eps"],
        "max_position_embeddings": draft["max_position_embeddings"],
        "rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0),
        "attention_bias": False, "mlp_bias": False, "num_hidden_layers": 1,
        "vocab_size": draft["vocab_size"], "tie_word_embeddings": False,
        "bos_token_id": tcfg.bos_token_id, "eos_token_id": tcfg.eos_token_id,
        "pad_token_id": getattr(tcfg, "pad_token_id", None), "torch_dtype": dtype, "dtype": dtype,
    }


def config_json(draft: dict, target, fmt: str, dtype: str, num_draft_tokens: int, options: dict | None = None) -> dict:
    """config.json for the draft config `d` (a trained draft's "draft" section)."""
    layer = llama_layer_config(draft, target, dtype)
    eagle = {"draft_vocab_size": draft["draft_vocab_size"], "target_hidden_size": draft["target_hidden_size"],
             # vLLM's convention ("entering layer i" = HF hidden_states[i]), the same as ours.
             "eagle_aux_hidden_state_layer_ids": list(draft["aux_layer_ids"]),
             "num_aux_hidden_states": len(draft["aux_layer_ids"]),  # sizes vLLM's fc input (llama_eagle3.py)
             "norm_before_residual": bool(draft["norm_before_residual"]),
             # vLLM's options (llama_eagle3.py; the speculators loader passes them on, algos.py): absent in a
             # draft trained before they existed, which had neither
             "norm_before_fc": bool(draft.get("norm_before_fc", False)),
             "norm_output": bool(draft.get("norm_output", False))}
    if fmt == "vllm":
        return {"architectures": ["LlamaForCausalLMEagle3"], **layer, **eagle}
    target_arch = list(getattr(target.model.config, "architectures", None) or ["LlamaForCausalLM"])
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **layer},
        **eagle, "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.name, "architectures": target_arch},
        },
    }


def describe(manifest: dict) -> list[str]:
    """Model-card lines that say what this draft is."""
    draft = manifest["draft"]
    layout = "vLLM-native `LlamaForCausalLMEagle3`" if manifest["format"] == "vllm" else "speculators"
    return [f"- one Llama decoder layer (hidden {draft['hidden_size']}, {draft['num_attention_heads']} heads / "
            f"{draft['num_key_value_heads']} KV heads, MLP {draft['intermediate_size']}), "
            "`fc` fusing the target's hidden "
            f"states entering layers {draft['aux_layer_ids']} (vLLM's `eagle_aux_hidden_state_layer_ids`)",
            f"- draft vocabulary {draft['draft_vocab_size']:,} of the target's {draft['vocab_size']:,} tokens (`d2t`); "
            "the token embedding is the target's (not included)",
            f"- layout: {layout}"] + (
        [f"- vLLM's norm options on: {', '.join(f'`{n}`' for n in norms)}"] if (norms := [
            n for n in ("norm_before_fc", "norm_output", "norm_before_residual") if draft.get(n)]) else [])


TITLE = "EAGLE-3 draft model"

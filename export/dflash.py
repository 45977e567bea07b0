"""The DFlash exporter: vLLM's `DFlashDraftModel` layout (vllm/model_executor/models/qwen3_dflash.py).

config.json is a Qwen3 config of the draft layers (q_norm/k_norm attention; vLLM serves
DFlash only this way, whatever the target's architecture) plus
    dflash_config: {mask_token_id, target_layer_ids}   output-of-layer ids: vLLM reads i + 1
                                                       (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)
    block_size, num_target_layers, target_hidden_size  ours to record (vLLM takes N from
                                                       num_speculative_tokens and ignores block_size)
    rope_parameters, max_position_embeddings           written explicitly (>= the target's)
    layer_types, dflash_config.{swa_window_size, causal: false}
                                                       only for a sliding-window draft (below)
and never a top-level `eagle_aux_hidden_state_layer_ids`, which vLLM would read instead of
target_layer_ids, without the +1. Weights keep our names (fc, hidden_norm, layers.N.*,
norm); the embedding and LM head are the target's unless the draft has a reduced
vocabulary (lm_head + d2t; vLLM skips t2d).

A sliding-window draft (draft.sliding_window W): vLLM 0.32/0.34 qwen3_dflash.py
_resolve_layer_attention gives layer i the window `dflash_config.swa_window_size` where
`layer_types[i] == "sliding_attention"`, and _dflash_layer_causal makes such a layer CAUSAL
unless `dflash_config.causal` (or a top-level `is_causal`) says otherwise: the draft's block is
bidirectional, so `causal: false` is written with the window. The window itself (which keys a
query sees) is trainer/drafts/dflash.py `window_mask`.
"""

from __future__ import annotations

from trainer.drafts.registry import VLLM_METHOD
from trainer.drafts.shape import flat_rope
from trainer.errors import DraftsmithError
from trainer.layer_ids import entering_to_output

METHOD = VLLM_METHOD["dflash"]  # vLLM's speculative-config method
FORMATS = ("vllm",)
FP8_FORMATS = ("vllm",)
TITLE = "DFlash draft model"
KEEP_BF16 = {"lm_head": "lm_head"}  # vLLM runs the draft at `model.`; lm_head stays at the top
KEEP_BF16_UNLESS_ASKED = {"fc": "model.fc"}

OPTIONS: dict[str, str] = {}  # proposer options written into config.json (none for DFlash)


def key_map(fmt: str, names: list[str]) -> dict[str, str]:
    """Our names (the draft module's state-dict keys) are vLLM's: fc, hidden_norm, layers.N.*,
    norm, and lm_head/d2t/t2d with a reduced vocabulary."""
    if fmt != "vllm":
        raise DraftsmithError(f"unknown DFlash export format '{fmt}'; use one of {', '.join(FORMATS)}")
    return {k: k for k in names}


def keep_bf16(draft: dict, quantize_fc: bool = False, quantize_qkv: bool = True) -> dict[str, str]:
    """{file/Quark name: vLLM runtime name} of the layers that stay BF16 in an FP8 export
    (lm_head only where the draft has its own: otherwise it is the target's, not in the file).
    q/k/v stay BF16 together or not at all (vLLM fuses them); vLLM 0.32 then projects the
    context through the raw BF16 weight instead of the FP8 quant method."""
    own_head = draft.get("draft_vocab_size") is not None
    keep = {**(KEEP_BF16 if own_head else {}), **({} if quantize_fc else KEEP_BF16_UNLESS_ASKED)}
    if not quantize_qkv:
        keep.update({f"layers.{i}.self_attn.{p}_proj": f"model.layers.{i}.self_attn.{p}_proj"
                     for i in range(draft["num_hidden_layers"]) for p in "qkv"})
    return keep


def target_layer_ids(draft: dict) -> list[int]:
    """Our entering-layer ids -> vLLM's DFlash output-of-layer ids (vLLM adds 1 back)."""
    return [entering_to_output(i) for i in draft["aux_layer_ids"]]


def sliding_window_fields(draft: dict) -> tuple[list[str] | None, dict]:
    """(layer_types, the dflash_config keys) of a sliding-window draft, (None, {}) without one:
    "sliding_attention" for the windowed layers (all, unless sliding_window_layers names some),
    swa_window_size W, and causal false (vLLM makes a sliding layer causal by default)."""
    window = draft.get("sliding_window")
    if window is None:
        return None, {}
    L = draft["num_hidden_layers"]
    layers = set(range(L) if draft.get("sliding_window_layers") is None else draft["sliding_window_layers"])
    return (["sliding_attention" if i in layers else "full_attention" for i in range(L)],
            {"swa_window_size": window, "causal": False})


def config_json(draft: dict, target, fmt: str, dtype: str, num_draft_tokens: int, options: dict | None = None) -> dict:
    tcfg = target.model.config.get_text_config()
    rope = flat_rope(draft["rope_parameters"])  # one flat dict, whatever the target's layer types
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": draft["hidden_size"], "intermediate_size": draft["intermediate_size"],
        "num_hidden_layers": draft["num_hidden_layers"], "num_attention_heads": draft["num_attention_heads"],
        "num_key_value_heads": draft["num_key_value_heads"], "head_dim": draft["head_dim"], "hidden_act": "silu",
        "rms_norm_eps": draft["rms_norm_eps"], "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": max(draft["max_position_embeddings"], tcfg.max_position_embeddings),
        "rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0),
        "vocab_size": draft["vocab_size"], "target_hidden_size": draft["target_hidden_size"],
        "block_size": draft["block_size"], "num_target_layers": len(draft["aux_layer_ids"]),
        "dflash_config": {"mask_token_id": draft["mask_token_id"], "target_layer_ids": target_layer_ids(draft)},
        "bos_token_id": tcfg.bos_token_id, "eos_token_id": tcfg.eos_token_id,
        "torch_dtype": dtype, "dtype": dtype,
    }
    if draft.get("draft_vocab_size") is not None:
        cfg["draft_vocab_size"] = draft["draft_vocab_size"]
    layer_types, window = sliding_window_fields(draft)
    if layer_types is not None:
        cfg["layer_types"] = layer_types
        cfg["dflash_config"].update(window)
    return cfg


def describe_window(draft: dict) -> list[str]:
    """The model card's line on a sliding-window draft (none without one)."""
    layer_types, window = sliding_window_fields(draft)
    if layer_types is None:
        return []
    layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    which = "every layer" if len(layers) == len(layer_types) else f"layers {layers}"
    return [f"- attention: a sliding window of {window['swa_window_size']} positions in {which} (a query at "
            f"position t sees the context and block keys at positions within {window['swa_window_size'] - 1} "
            "of t; vLLM's `layer_types` \"sliding_attention\" and `dflash_config.swa_window_size`)"]


def describe(manifest: dict) -> list[str]:
    draft = manifest["draft"]
    return [f"- {draft['num_hidden_layers']} Qwen3-style decoder layer(s) (hidden {draft['hidden_size']}, "
            f"{draft['num_attention_heads']} heads / {draft['num_key_value_heads']} KV heads, "
            f"MLP {draft['intermediate_size']}) "
            f"drafting blocks of {draft['block_size']} ([anchor, mask x {draft['block_size'] - 1}], mask token "
            f"{draft['mask_token_id']}) in one forward",
            f"- context: `fc` fusing the target's hidden states at output-of-layer ids {target_layer_ids(draft)} "
            "(vLLM's `dflash_config.target_layer_ids`)",
            *describe_window(draft),
            "- vocabulary: " + (f"{draft['draft_vocab_size']:,} of the target's {draft['vocab_size']:,} tokens (`d2t`)"
                                if draft.get("draft_vocab_size") else "the target's LM head (not included)")
            + "; the token embedding is the target's (not included)",
            "- layout: vLLM `DFlashDraftModel` (`--speculative-config '{\"method\": \"dflash\", ...}'`)"]

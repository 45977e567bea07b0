"""Aux layer ids: the one convention draftsmith stores, and the conversions to the other.

draftsmith stores aux layer ids in vLLM's convention everywhere (`LAYER_ID_CONVENTION`):
id i is the residual stream *entering* decoder layer i, which is HF `hidden_states[i]`
(vllm/model_executor/models/llama.py collects `aux_hidden_states` before calling layer i).
Valid ids are 0..L; id L is the output of the last decoder layer *before* the final norm.
HF's `hidden_states[-1]` is after the final norm and is never used. SGLang/SpecForge and
DFlash/DSpark `target_layer_ids` count "output of layer i" = HF `hidden_states[i + 1]`:
`output_to_entering` / `entering_to_output` convert.
"""

from __future__ import annotations

from trainer.errors import ConfigError

# The one spelling of the one convention, written into every manifest and checked where read.
LAYER_ID_CONVENTION = "entering-layer"
LAYER_ID_MEANING = ("id i = the residual stream entering decoder layer i = HF hidden_states[i]; id L = last "
                    "layer's output before the final norm")


def output_to_entering(layer_id: int) -> int:
    """SGLang/SpecForge/DFlash "output of layer i" -> vLLM "entering layer i+1"."""
    return layer_id + 1


def entering_to_output(layer_id: int) -> int:
    """vLLM "entering layer i" -> "output of layer i-1" (SGLang/SpecForge/DFlash)."""
    if layer_id < 1:
        raise ValueError(f"layer id {layer_id} (entering) is the embedding output; it has no 'output of layer' id")
    return layer_id - 1


def check_layer_ids(ids, what: str) -> None:
    """Aux layer ids must be non-empty, unique and strictly increasing: vLLM collects each
    layer once, in ascending order, and concatenates them in that order, so any other list
    pairs fc's input columns with the wrong layers and serves silent garbage."""
    ids = list(ids) if isinstance(ids, (list, tuple)) else ids
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"{what} is empty or not a list; list at least one layer id")
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ConfigError(f"{what} {ids} must be integers")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"{what} {ids} must be unique and strictly increasing (vLLM reads the layers in "
                          f"ascending order); use {sorted(set(ids))}")

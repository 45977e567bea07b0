"""The draft fields every algorithm takes from its target, and what `draft_vocab_size` means.

One home for both: each algorithm's Config inherits `TargetShape` (the fields are plain
dataclass fields, so a trained draft's config.json and every YAML keep their flat layout).

draft_vocab_size, one rule for every algorithm:
    null        the capture's draft vocabulary where the draft must have its own head
                (EAGLE-3), else the target's full LM head (block drafts: shared, not saved)
    an int      a draft vocabulary of that many tokens (the most frequent assistant tokens,
                built from the capture's counts), at most the capture's size
    larger      one clear line naming both sizes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trainer.errors import ConfigError
from trainer.families import intermediate_size, norm_eps
from trainer.losses import parse_objective

# The size a capture builds when nothing says otherwise (the EAGLE-3 reference's Vd).
DEFAULT_DRAFT_VOCAB_SIZE = 32000


def check_objective(text: str, eta: float, extra: tuple[str, ...] = ()) -> None:
    """`draft.loss` (trainer/losses.py's objectives, or one of `extra`: an algorithm's own) and
    `draft.lk_eta`, or one line saying what to write."""
    if text not in extra:
        try:
            parse_objective(text)
        except ValueError as err:
            also = f" (or {', '.join(extra)})" if extra else ""
            raise ConfigError(f"draft.loss={text}: {err}; write one objective, e.g. draft.loss=tv, or weighted "
                              f"terms, e.g. draft.loss=ce:0.1,tv:0.9{also}") from None
    if not eta > 0:
        raise ConfigError(f"draft.lk_eta={eta} must be > 0 (lk_hybrid's λ = exp(-lk_eta α))")


def to_draft_ids(draft, target_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft-vocabulary ids, -1 where the reduced vocabulary lacks the token
    (no loss there: it cannot be predicted); unchanged with the target's full head."""
    cfg = draft.config
    if cfg.draft_vocab_size is None:
        return target_ids
    inv = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
    inv[draft.draft_to_target()] = torch.arange(cfg.draft_vocab_size, device=target_ids.device)
    return inv[target_ids]


def flat_rope(rope: dict | None, rope_theta: float = 10000.0) -> dict:
    """RoPE parameters as one flat dict, what a Llama/Qwen3 draft config carries (vLLM's
    get_rope hashes it: a nested dict raises "unhashable type"). Per-layer-type parameters
    (Gemma-3: {"full_attention": {...}, "sliding_attention": {...}}) give the full-attention
    ones: the draft's attention is global. None gives the default RoPE at `rope_theta`."""
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    return dict(rope) if rope else {"rope_type": "default", "rope_theta": rope_theta}


def flat_rope_parameters(t) -> dict:
    """The target config `t`'s RoPE, flat (flat_rope); older configs give their rope_theta."""
    return flat_rope(getattr(t, "rope_parameters", None), getattr(t, "rope_theta", 10000.0))


@dataclass
class TargetShape:
    """Fields a draft takes from the target unless set (null = the target's)."""

    hidden_size: int | None = None  # H; must equal the target's (the draft shares its embedding)
    intermediate_size: int | None = None  # I
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float | None = None
    max_position_embeddings: int | None = None
    rope_parameters: dict | None = None  # the target's, flat (flat_rope_parameters)
    target_hidden_size: int | None = None  # Ht
    vocab_size: int | None = None  # V, the target's
    draft_vocab_size: int | None = None  # Vd: see the module docstring
    aux_layer_ids: list[int] | None = None  # entering-layer convention; null: the capture's choice for this draft

    # Whether the draft always has its own head over a draft vocabulary (EAGLE-3), or shares
    # the target's full head unless given a draft_vocab_size (block drafts).
    needs_own_head: ClassVar[bool] = False

    def fill_from_target(self, target_config, aux_layer_ids, data_vocab_size: int | None = None):
        """Null shape fields from the target's text config (by the names its family gives them:
        trainer/families.py); null aux_layer_ids from the capture's choice; draft_vocab_size by
        the rule above (`data_vocab_size`: the size of the vocabulary the capture built)."""
        t = target_config
        for name, value in (("hidden_size", t.hidden_size), ("intermediate_size", intermediate_size(t)),
                            ("num_attention_heads", t.num_attention_heads),
                            ("num_key_value_heads", getattr(t, "num_key_value_heads", None) or t.num_attention_heads),
                            ("head_dim", getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads),
                            ("rms_norm_eps", self.rms_norm_eps or norm_eps(t)),
                            ("max_position_embeddings", t.max_position_embeddings),
                            ("rope_parameters", flat_rope_parameters(t)),
                            ("target_hidden_size", t.hidden_size), ("vocab_size", t.vocab_size)):
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.aux_layer_ids is None:
            self.aux_layer_ids = list(aux_layer_ids)
        if self.draft_vocab_size is None:
            if self.needs_own_head:
                self.draft_vocab_size = data_vocab_size
        elif data_vocab_size is not None and self.draft_vocab_size > data_vocab_size:
            raise ConfigError(f"draft.draft_vocab_size={self.draft_vocab_size} is larger than the capture's draft "
                              f"vocabulary ({data_vocab_size} tokens); use at most {data_vocab_size}, or null "
                              + ("for the capture's" if self.needs_own_head else "for the target's full LM head"))
        return self

    def validate_shape(self) -> None:
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ConfigError("draft.draft_vocab_size must be >= 1, or null (see trainer/drafts/shape.py)")

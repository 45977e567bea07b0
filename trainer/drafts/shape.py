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
from trainer.settings import setting

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


def lk_eta_setting():
    """`draft.lk_eta`, declared once for every algorithm's Config (the field keeps its place in each)."""
    return setting(3.0, "lk_hybrid's η: λ = exp(-η α)", gt=0)


def loss_chunk_rows_setting():
    """`draft.loss_chunk_rows`, declared once for every algorithm's Config (trainer/losses.py's
    in_row_chunks)."""
    return setting(1024, "rows of the loss ([rows, Vd] logits, log-probabilities and target distribution) alive at "
                         "once; more are computed in chunks recomputed in backward (long samples and large "
                         "vocabularies in bounded memory: at Qwen3-8B's 151,936 tokens, DFlash's 512 anchors x 15 "
                         "slots of fp32 logits are 4.7 GB unchunked); 0: one pass", ge=0)


def loss_on_setting():
    """`draft.loss_on`, declared once for every algorithm's Config (the field keeps its place in each)."""
    return setting("assistant", "the positions trained: `assistant`, where the token predicted is the answer's (the "
                                "reference's loss mask; a block draft's anchors and slots inside the answers); `all`, "
                                "every real position of the sample (the target's distribution is a label at the "
                                "prompt's tokens too, at no extra capture)", choices=("assistant", "all"))


def supervised(batch: dict, loss_on: str) -> torch.Tensor:
    """[B, T] the tokens whose prediction may be trained (`draft.loss_on`): the assistant's (the
    batch's loss_mask), or every real one (its attention_mask)."""
    return batch["loss_mask"] if loss_on == "assistant" else batch["attention_mask"]


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

    hidden_size: int | None = setting(None, "H; null: the target's (EAGLE-3: must equal it, the draft shares its "
                                            "embedding)", ge=1)
    intermediate_size: int | None = setting(None, "the MLP's width I; null: the target's", ge=1)
    num_attention_heads: int | None = setting(None, "attention heads; null: the target's", ge=1)
    num_key_value_heads: int | None = setting(None, "key/value heads; null: the target's", ge=1)
    head_dim: int | None = setting(None, "the attention head's width; null: the target's", ge=1)
    rms_norm_eps: float | None = setting(None, "RMSNorm's epsilon; null: the target's", gt=0)
    max_position_embeddings: int | None = setting(None, "positions; null: the target's", ge=1)
    rope_parameters: dict | None = setting(None, "RoPE's parameters, flat; null: the target's "
                                                 "(flat_rope_parameters)")
    target_hidden_size: int | None = setting(None, "the target's width Ht; null: read from the target", ge=1)
    vocab_size: int | None = setting(None, "the target's vocabulary V; null: read from the target", ge=1)
    draft_vocab_size: int | None = setting(None, "Vd, the draft vocabulary: null, the capture's where the draft "
                                                 "has its own head (EAGLE-3), else the target's full head; an int, "
                                                 "that many most frequent assistant tokens (trainer/drafts/shape.py)",
                                           ge=1)
    aux_layer_ids: list[int] | None = setting(None, "the target layers the draft reads, entering-layer convention; "
                                                    "null: the capture's choice for this draft")

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

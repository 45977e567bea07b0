"""The `export` stage's schema (recipes/export_draft.py): a trained draft -> a vLLM folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from trainer.errors import ConfigError


@dataclass
class ExportConfig:
    """`draftsmith export`: a trained draft -> a folder vLLM loads (BF16, or FP8 via AMD Quark)."""

    draft: str = MISSING  # a recipes/train.py output_dir
    output_dir: str = MISSING
    target: str | None = None  # null: the target the draft records (it must be the one it was trained on)
    format: str = "vllm"  # the algorithm's exporter says which it writes (EAGLE-3: vllm | speculators)
    dtype: str = "bfloat16"  # of the unquantized tensors: bfloat16 | float16 | float32
    quantize: str = "none"  # none | fp8
    fp8_scheme: str = "ptpc_fp8"  # per-channel FP8 weights + dynamic per-token FP8 activations
    quantize_fc: bool = False  # AMD's shipped FP8 drafts keep fc in BF16
    # q/k/v FP8 (false: BF16, all layers; scripts/compare_drafts.py measured the gate's τ both ways)
    quantize_qkv: bool = True
    # N written into the serve command (and speculators_config, and the FP8 gate). null: the
    # positions the draft was trained on (Config.num_positions).
    num_draft_tokens: int | None = None
    # Proposer options the export serves with (written where vLLM reads them, e.g. DSpark's
    # draft_topk as dspark_draft_topk); the FP8 gate decodes with them too.
    draft_options: dict[str, Any] = field(default_factory=dict)
    # FP8 acceptance gate: τ of the FP8 draft vs its BF16 source, in-tree, greedy, held-out prompts.
    gate: bool = True
    gate_dataset: str = "mtbench"  # not a training source: held out
    gate_prompts: int = 8
    gate_max_new_tokens: int = 64
    max_tau_drop: float = 0.05  # relative: fail when tau_fp8 < (1 - max_tau_drop) * tau_bf16
    # The gate prompts' chat template, as for eval: null = the draft's data template, else the target's.
    chat_template: str | None = None
    no_chat_template: bool = False
    overwrite: bool = False
    require_servable: bool = False  # as capture's: an error, not a warning, when vLLM cannot serve the draft

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype '{self.dtype}' is not one of bfloat16, float16, float32")
        if self.quantize not in ("none", "fp8"):
            raise ConfigError(f"quantize '{self.quantize}' is not one of none, fp8")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ConfigError("num_draft_tokens must be >= 1, or null for the positions the draft was trained on")
        if self.gate_prompts < 1 or self.gate_max_new_tokens < 1:
            raise ConfigError("gate_prompts and gate_max_new_tokens must be >= 1")
        if not 0 <= self.max_tau_drop < 1:
            raise ConfigError("max_tau_drop is a fraction of the BF16 τ in [0, 1)")
        if self.no_chat_template and self.chat_template is not None:
            raise ConfigError(f"chat_template={self.chat_template} and no_chat_template=true ask for both a template "
                              "and none; drop one of them")

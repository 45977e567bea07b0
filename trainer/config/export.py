"""The `export` stage's schema (recipes/export_draft.py): a trained draft -> a vLLM folder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError
from trainer.settings import setting


@dataclass
class ExportConfig:
    """`draftsmith export`: a trained draft -> a folder vLLM loads (BF16, or FP8 via AMD Quark)."""

    draft: str = setting(help="the trained draft folder (recipes/train.py output_dir)")
    output_dir: str = setting(help="the export folder written")
    target: str | None = setting(None, "the target; null: the one the draft records (it must be the one it was "
                                       "trained on)")
    format: str = setting("vllm", "the layout written; the algorithm's exporter says which it writes (EAGLE-3: "
                                  "vllm | speculators)")
    dtype: str = setting("bfloat16", "the dtype of the unquantized tensors",
                         choices=("bfloat16", "float16", "float32"))
    quantize: str = setting("none", "quantization: none, or fp8 (AMD Quark)", choices=("none", "fp8"))
    fp8_scheme: str = setting("ptpc_fp8", "the FP8 scheme: per-channel FP8 weights + dynamic per-token FP8 "
                                          "activations")
    quantize_fc: bool = setting(False, "fc in FP8 too (AMD's shipped FP8 drafts keep it in BF16)")
    quantize_qkv: bool = setting(True, "q/k/v in FP8 (false: BF16, all layers; scripts/compare_drafts.py measured "
                                       "the gate's τ both ways)")
    num_draft_tokens: int | None = setting(None, "N written into the serve command (and speculators_config, and "
                                                 "the FP8 gate); null: the positions the draft was trained on", ge=1)
    draft_options: dict[str, Any] = setting(help="proposer options the export serves with, written where vLLM "
                                                 "reads them (e.g. DSpark's draft_topk as dspark_draft_topk); the FP8 "
                                                 "gate decodes with them too", factory=dict)
    gate: bool = setting(True, "the FP8 acceptance gate: τ of the FP8 draft vs its BF16 source, in-tree, greedy, "
                               "held-out prompts")
    gate_dataset: str = setting("mtbench", "the gate's prompts (held out: not a training source)")
    gate_prompts: int = setting(8, "the gate's prompts", ge=1)
    gate_max_new_tokens: int = setting(64, "tokens generated per gate prompt", ge=1)
    max_tau_drop: float = setting(0.05, "the gate's tolerance, relative: fail when tau_fp8 < (1 - max_tau_drop) x "
                                        "tau_bf16", ge=0, lt=1)
    chat_template: str | None = setting(None, "the gate prompts' chat template, as for eval; null: the draft's "
                                              "data template, else the target's")
    no_chat_template: bool = setting(False, "the gate prompts as they are, no chat template (base models)")
    overwrite: bool = setting(False, "replace an earlier export in output_dir")
    require_servable: bool = setting(False, "an error, not a warning, when the installed vLLM cannot serve the "
                                            "draft")

    def validate(self) -> None:
        if self.no_chat_template and self.chat_template is not None:
            raise ConfigError(f"chat_template={self.chat_template} and no_chat_template=true ask for both a template "
                              "and none; drop one of them")

"""The demo's schema (recipes/demo.py): its own fields and the stage sections it assembles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config.capture import CaptureConfig
from trainer.config.prepare import PrepareConfig
from trainer.config.train import TrainConfig
from trainer.drafts.registry import get
from trainer.errors import ConfigError
from trainer.target import DEFAULT_TARGET


@dataclass
class DemoConfig:
    """The whole pipeline on the embedded target: prepare -> capture -> train a draft ->
    export BF16 and FP8 -> evaluate both. `target` applies to every stage; the stage sections
    hold what the demo does not set itself (paths, the target and the algorithm are its)."""

    output_dir: str = "runs/demo"
    target: str = DEFAULT_TARGET
    algorithm: str = "eagle3"  # the draft trained, exported and evaluated (a key of trainer.drafts.registry.DRAFTS)
    overwrite: bool = False  # replace an earlier demo's output_dir
    prepare: PrepareConfig = field(default_factory=lambda: PrepareConfig(output_dir="(set by the demo)"))
    capture: CaptureConfig = field(
        default_factory=lambda: CaptureConfig(data="(set by the demo)", output_dir="(set by the demo)")
    )
    train: TrainConfig = field(default_factory=lambda: TrainConfig(data="(set by the demo)",
                                                                   output_dir="(set by the demo)"))
    # The draft section (train.draft) per algorithm, so that `algorithm=` alone switches the demo.
    draft_by_algorithm: dict[str, Any] = field(default_factory=dict)
    # for export (the serve command), the FP8 gate and the evaluation; null: the positions the
    # draft is trained on (EAGLE-3's TTT steps, a DFlash block's K-1, a DSpark block's K)
    num_draft_tokens: int | None = None
    eval_dataset: str = "mtbench"  # held out from training (ShareGPT)
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    gate_prompts: int = 4
    quantize_fc: bool = False

    def validate(self) -> None:
        """The demo's own fields; the stage sections are assembled and checked by the demo
        (recipes/demo.py `stage_configs`), before any work."""
        get(self.algorithm)
        if (self.num_draft_tokens is not None and self.num_draft_tokens < 1) or self.eval_prompts < 1 \
                or self.gate_prompts < 1:
            raise ConfigError("num_draft_tokens (or null), eval_prompts and gate_prompts must be >= 1")

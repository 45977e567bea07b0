"""The demo's schema (recipes/demo.py): its own fields and the stage sections it assembles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config.capture import CaptureConfig
from trainer.config.prepare import PrepareConfig
from trainer.config.train import TrainConfig
from trainer.drafts.registry import get
from trainer.settings import setting
from trainer.target import DEFAULT_TARGET


@dataclass
class DemoConfig:
    """The whole pipeline on the embedded target: prepare -> capture -> train a draft ->
    export BF16 and FP8 -> evaluate both. `target` applies to every stage; the stage sections
    hold what the demo does not set itself (paths, the target and the algorithm are its)."""

    output_dir: str = setting("runs/demo", "the demo's folder: every stage's output inside it")
    target: str = setting(DEFAULT_TARGET, "the target of every stage: an embedded alias, an HF model folder or a "
                                          ".gguf file")
    algorithm: str = setting("eagle3", "the draft trained, exported and evaluated (a key of "
                                       "trainer.drafts.registry.DRAFTS)")
    overwrite: bool = setting(False, "replace an earlier demo's output_dir")
    prepare: PrepareConfig = setting(help="the prepare stage's section",
                                     factory=lambda: PrepareConfig(output_dir="(set by the demo)"))
    capture: CaptureConfig = setting(help="the capture stage's section",
                                     factory=lambda: CaptureConfig(data="(set by the demo)",
                                                                   output_dir="(set by the demo)"))
    train: TrainConfig = setting(help="the train stage's section",
                                 factory=lambda: TrainConfig(data="(set by the demo)", output_dir="(set by the demo)"))
    draft_by_algorithm: dict[str, Any] = setting(help="the draft section (train.draft) per algorithm, so that "
                                                      "algorithm= alone switches the demo", factory=dict)
    num_draft_tokens: int | None = setting(None, "N for export (the serve command), the FP8 gate and the "
                                                 "evaluation; null: the positions the draft is trained on", ge=1)
    eval_dataset: str = setting("mtbench", "the evaluation's prompts (held out from training: ShareGPT)")
    eval_prompts: int = setting(8, "the evaluation's prompts", ge=1)
    eval_max_new_tokens: int = setting(64, "tokens generated per evaluation prompt", ge=1)
    gate_prompts: int = setting(4, "the FP8 gate's prompts", ge=1)
    quantize_fc: bool = setting(False, "fc in FP8 too in the FP8 export")

    def validate(self) -> None:
        """The demo's own fields; the stage sections are assembled and checked by the demo
        (recipes/demo.py `stage_configs`), before any work."""
        get(self.algorithm)

"""Typed run configs: one dataclass schema per stage (a module each beside this one), loaded by
`loader.load_config` (dataclass defaults <- YAML file <- `key=value` overrides; unknown keys
are one line with a suggestion; each setting's default, help and bounds declared with it,
trainer/settings.py `setting`; cross-field checks in each schema's `validate()`). Every setting lives in its
schema, once: flags, --help and docs/config.md are built from it.
"""

from trainer.config.capture import CaptureConfig
from trainer.config.compare import CompareConfig
from trainer.config.demo import DemoConfig
from trainer.config.eval import NGRAM_DRAFT_TOKENS, EvalConfig
from trainer.config.export import ExportConfig
from trainer.config.loader import ConfigError, load_config, load_section, to_yaml
from trainer.config.prepare import PrepareConfig, RegenerateConfig
from trainer.config.train import TrainConfig
from trainer.drafts.registry import DRAFTS

# `draftsmith <stage>` -> its schema: the settings reference (docs/config.md) in this order.
STAGE_SCHEMAS = {"prepare": PrepareConfig, "capture": CaptureConfig, "train": TrainConfig, "export": ExportConfig,
                 "eval": EvalConfig, "compare": CompareConfig, "demo": DemoConfig}
# The settings reference (docs/config.md): the stages, then each algorithm's draft section (train.draft).
REFERENCE = {**STAGE_SCHEMAS, **{f"train.draft: {name}": module.Config for name, module in DRAFTS.items()}}
# YAML file stem -> schema (recipes/configs/*/<stem>.yaml); a draft's training config is named after it.
SCHEMAS = {"export": ExportConfig, "prepare": PrepareConfig, "eval": EvalConfig, "capture": CaptureConfig,
           "demo": DemoConfig, "compare": CompareConfig, **{name: TrainConfig for name in DRAFTS}}

__all__ = ["REFERENCE", "SCHEMAS", "STAGE_SCHEMAS", "CaptureConfig", "CompareConfig", "ConfigError", "DemoConfig",
           "EvalConfig", "ExportConfig", "NGRAM_DRAFT_TOKENS", "PrepareConfig", "RegenerateConfig", "TrainConfig",
           "load_config", "load_section", "to_yaml"]

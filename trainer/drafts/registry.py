"""The algorithm registry: one dict, `DRAFTS[name]` -> the module implementing the draft contract
(trainer/drafts/__init__.py), and every caller (training, evaluation, export, the demo) goes
through it."""

from __future__ import annotations

import difflib

from torch import nn

from trainer.drafts import dflash, dspark, eagle3
from trainer.errors import ConfigError

DRAFTS = {"eagle3": eagle3, "dflash": dflash, "dspark": dspark}
# vLLM's speculative-config method that serves each algorithm (vllm/config/speculative.py): what the
# exporters write and the servability check asks about, so that a stage reaches vLLM's wing
# without importing an exporter.
VLLM_METHOD = {"eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}


def get(algorithm: str):
    """The module for `algorithm`, or one line naming the known ones."""
    try:
        return DRAFTS[algorithm]
    except KeyError:
        close = difflib.get_close_matches(str(algorithm), list(DRAFTS), n=1)
        raise ConfigError(f"algorithm '{algorithm}' is not one of {', '.join(DRAFTS)}"
                          + (f"; did you mean '{close[0]}'?" if close else "")) from None


def build(algorithm: str, draft_config, target):
    """The draft for `target` from its config (a dataclass or a saved dict), sharing the
    target's embedding (as vLLM shares it: trainer.target.Target.token_embedding) and LM head
    (used where the draft has none of its own, or copied from when its head starts from the
    target's rows)."""
    algo = get(algorithm)
    cfg = draft_config if isinstance(draft_config, algo.Config) else algo.Config(**draft_config)
    return algo.Draft(cfg, target.token_embedding, target.lm_head)


class TrainStep(nn.Module):
    """The unit DDP/DeepSpeed wrap: its forward is one training step of the draft."""

    def __init__(self, algorithm: str, draft: nn.Module):
        super().__init__()
        self.draft = draft
        self._step = get(algorithm).training_step

    def forward(self, batch: dict, labels: dict):
        return self._step(self.draft, batch, labels)

"""One module per draft algorithm: its config, the served nn.Module and its training step.

The registry is one dict: `DRAFTS[name]` -> the module implementing it.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.drafts import eagle3
from trainer.errors import DraftsmithError

DRAFTS = {"eagle3": eagle3}


def load_draft(path: str | Path, target):
    """A trained draft folder (recipes/train.py output) -> its module, on the target's device,
    sharing the target's embedding. The folder must have been trained for this target."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise DraftsmithError(f"'{path}' is not a trained draft (needs config.json and model.safetensors)")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("algorithm") not in DRAFTS:
        raise DraftsmithError(f"{path}/config.json: algorithm {cfg.get('algorithm')!r} is not one of {', '.join(DRAFTS)}")
    if cfg["target"]["sha256"] != target.content_hash:
        raise DraftsmithError(f"draft '{path}' was trained for {cfg['target']['name']} "
                              f"({cfg['target']['sha256'][:12]}), not {target.name} ({target.content_hash[:12]})")
    module = DRAFTS[cfg["algorithm"]]
    draft = module.Eagle3Draft(module.Eagle3Config(**cfg["draft"]), target.backbone.embed_tokens)
    draft.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    return draft.to(target.device, target.dtype)

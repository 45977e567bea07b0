"""Draft algorithms. The registry is one dict, `DRAFTS[name]` -> the module implementing
it, and every caller (training, evaluation, export, the demo) goes through it.

The draft contract: each module under trainer/drafts/ provides

    Config                      dataclass: the draft's shape and its objective. Null shape
                                fields come from the target (`fill_from_target(target_config,
                                aux_layer_ids, draft_vocab_size)`); `validate()`; `num_positions`
                                (K, the draft positions trained and measured per sample position).
    default_layer_ids(L)        aux layer ids for a target of L layers, strictly increasing, in
                                the one convention draftsmith stores (trainer.target.LAYER_ID_CONVENTION)
    Draft                       the served nn.Module (the target's embedding, and LM head where the
                                draft has none of its own, are shared, frozen, outside its state
                                dict); `set_vocab(d2t, t2d)`, `draft_to_target()`
    build(cfg, target)          the Draft for a target
    fill_from_data(cfg, counts, special_ids)
                                config fields taken from the training data (DFlash, DSpark: the mask token)
    target_labels(target, batch, draft) -> dict
                                the labels from the captured states (and the captured
                                target_argmax), no grad
    training_step(draft, batch, labels) -> trainer.metrics.StepMetrics
                                loss and per-position correct/count
    Proposer(draft, draft_sampling, seed, **options)
                                the in-tree decoder's draft (trainer.speculative.Draft protocol);
                                `max_draft_tokens` is the largest N it supports (None: any);
                                `OPTIONS` names the keyword options it takes (DSpark: markov, draft_topk)

Serialization is not a draft's business: export/ holds one exporter per algorithm under
the same registry name (file layouts, config.json, what stays BF16 under Quark, the probe).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from trainer.drafts import dflash, dspark, eagle3
from trainer.errors import ConfigError, DraftsmithError

DRAFTS = {"eagle3": eagle3, "dflash": dflash, "dspark": dspark}


def get(algorithm: str):
    """The module for `algorithm`, or one line naming the known ones."""
    try:
        return DRAFTS[algorithm]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(algorithm), list(DRAFTS), n=1)
        raise ConfigError(f"algorithm '{algorithm}' is not one of {', '.join(DRAFTS)}"
                          + (f"; did you mean '{close[0]}'?" if close else "")) from None


def build(algorithm: str, draft_config: dict, target):
    """A draft module from its saved config dict, sharing the target's embedding."""
    algo = get(algorithm)
    return algo.build(algo.Config(**draft_config), target)


class TrainStep(nn.Module):
    """The unit DDP/DeepSpeed wrap: its forward is one training step of the draft."""

    def __init__(self, algorithm: str, draft: nn.Module):
        super().__init__()
        self.draft = draft
        self._step = get(algorithm).training_step

    def forward(self, batch: dict, labels: dict):
        return self._step(self.draft, batch, labels)


def config_digest(cfg) -> str:
    """sha256 of a draft config (dataclass or its dict), as recorded in a trained draft's
    config.json: a hand-edited draft section (other layer ids, say) is refused on load."""
    import dataclasses
    import hashlib

    d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def check_draft_dir(path: Path, cfg: dict) -> None:
    """A trained draft folder's weights and draft section are what training wrote (their
    sha256 in config.json), and it trained at least one step."""
    from trainer.target import sha256_file

    if cfg.get("steps") == 0:
        raise DraftsmithError(f"'{path}' was trained for 0 steps: its weights are the initialization; train it "
                              "(max_steps >= 1) first")
    if cfg.get("draft_sha256") and config_digest(cfg["draft"]) != cfg["draft_sha256"]:
        raise DraftsmithError(f"{path}/config.json: the 'draft' section was changed after training (its sha256 "
                              "differs); restore it or train again")
    if cfg.get("weights_sha256") and sha256_file(path / "model.safetensors") != cfg["weights_sha256"]:
        raise DraftsmithError(f"{path}/model.safetensors does not match the sha256 recorded in config.json "
                              "(changed after training?); restore it or train again")


def load_draft(path: str | Path, target):
    """A trained draft folder (recipes/train.py output) -> (algorithm, its module) on the
    target's device, sharing the target's embedding. The folder must have been trained
    for this target."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise DraftsmithError(f"'{path}' is not a trained draft (needs config.json and model.safetensors)")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise DraftsmithError(f"{path}/config.json is not valid JSON ({err}); train again") from None
    check_draft_dir(path, cfg)
    if cfg.get("algorithm") not in DRAFTS:
        raise DraftsmithError(f"{path}/config.json: algorithm {cfg.get('algorithm')!r} is not one of {', '.join(DRAFTS)}")
    if cfg["target"]["sha256"] != target.content_hash:
        raise DraftsmithError(f"draft '{path}' was trained for {cfg['target']['name']} "
                              f"({cfg['target']['sha256'][:12]}), not {target.name} ({target.content_hash[:12]})")
    draft = build(cfg["algorithm"], cfg["draft"], target)
    draft.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    return cfg["algorithm"], draft.to(target.device, target.dtype)

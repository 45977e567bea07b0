"""Trained drafts and exports as in-tree proposers: the one loader every recipe, script and test uses
(`load_proposer`), and the check of the options an algorithm's proposer takes (`check_options`).

A trained draft folder loads through trainer/drafts/folder.py, an export through export/formats.py
(BF16, or FP8 simulated as vLLM computes it); either way the algorithm's Proposer comes from the draft
registry, so eval, export's τ gate, compare and the benchmarks measure the same object."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

from export import formats
from trainer.drafts.folder import load_draft
from trainer.drafts.registry import get
from trainer.errors import DraftsmithError


def load_proposer(path: str, target, draft_sampling: str = "greedy", seed: int = 0, **options):
    """A trained draft folder or an export (BF16, or FP8 simulated) -> (its in-tree proposer,
    a description), through the draft registry. `options` go to the algorithm's Proposer and
    must be among its OPTIONS (DSpark: markov, draft_topk). An export proposes as vLLM serves
    it: the options it wrote into its config.json (recorded in its manifest) apply unless
    `options` names them."""
    if not Path(path).is_dir():
        raise DraftsmithError(f"draft '{path}' is neither 'ngram', a trained draft folder nor an export")
    if (Path(path) / formats.EXPORT_MANIFEST).is_file():
        manifest = json.loads((Path(path) / formats.EXPORT_MANIFEST).read_text())
        kind = f"FP8 {manifest['quantization']['scheme']}" if manifest.get("quantization") else manifest["dtype"]
        algorithm, draft = formats.load_export(path, target)
        name = f"{algorithm} {kind} ({path})"
        served = {k: v for k, v in (manifest.get("draft_options") or {}).items() if v is not None}
        options = {**served, **options}
        if served:
            name += " with " + ", ".join(f"{k}={v}" for k, v in served.items())
        served_n = manifest.get("num_draft_tokens")  # the N its serve command names: its default N
    else:
        algorithm, draft = load_draft(path, target)
        name = f"{algorithm} ({path})"
        served_n = None
    proposer = get(algorithm).Proposer
    options = check_options(proposer, options, f"{algorithm} drafts ('{path}')")
    made = proposer(draft, draft_sampling=draft_sampling, seed=seed, **options)
    made.num_positions = draft.config.num_positions  # what it was trained on: a trained draft's default N
    made.served_num_draft_tokens = served_n if isinstance(served_n, int) and served_n >= 1 else None
    made.options = options  # what it proposes with (an export's served options included)
    return made, name


def _fits(value, expected) -> bool:
    """`value` is of the annotated type `expected` (bool a real bool, int an integer that is
    not a bool, float any such number; a union: any of its members); other types: not checked."""
    if isinstance(expected, types.UnionType) or typing.get_origin(expected) is typing.Union:
        return any(_fits(value, t) for t in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    return True


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _type_name(expected) -> str:
    if isinstance(expected, types.UnionType) or typing.get_origin(expected) is typing.Union:
        return " or ".join(_type_name(t) for t in typing.get_args(expected))
    return _TYPE_NAMES.get(expected, getattr(expected, "__name__", str(expected)))


def check_options(proposer, options: dict, what: str) -> dict:
    """Proposer options must be ones the algorithm declares (its OPTIONS), each of the type its
    Proposer's __init__ annotates (a bool: true or false, also as the strings a quoted YAML value
    gives; an int: an integer, never a bool). Returns the options, such strings made bools."""
    unknown = sorted(set(options) - set(proposer.OPTIONS))
    if unknown:
        raise DraftsmithError(f"{', '.join(unknown)}: not an option of {what}; they take "
                              f"{', '.join(proposer.OPTIONS) or 'none'}")
    hints = typing.get_type_hints(proposer.__init__)
    checked = {}
    for key, value in options.items():
        expected = hints.get(key)
        if isinstance(value, str) and value.lower() in ("true", "false") and expected is not None \
                and _fits(True, expected) and not _fits(value, expected):
            value = value.lower() == "true"
        if expected is not None and not _fits(value, expected):
            raise DraftsmithError(f"draft option {key}={value!r} is not {_type_name(expected)} (what {what} take "
                                  f"for {key}); pass e.g. --draft-option {key}={_example(expected)}")
        checked[key] = value
    return checked


def _example(expected) -> str:
    members = [t for t in typing.get_args(expected) if t is not type(None)] or [expected]
    return {bool: "false", int: "64", float: "0.5"}.get(members[0], "VALUE")


__all__ = ["check_options", "load_proposer"]

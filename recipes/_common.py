"""What every recipe's `main` shares: `--config FILE key=value ...` parsing and the
one-line error contract (a `DraftsmithError` prints one line and exits 2)."""

from __future__ import annotations

import argparse
import functools
import sys

from trainer.config import load_config
from trainer.errors import DraftsmithError


def parse_args(schema, argv: list[str] | None, description: str):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="a YAML under recipes/configs/ (optional: defaults + overrides work too)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. output_dir=runs/x max_length=1024")
    args = parser.parse_args(argv)
    return load_config(schema, args.config, args.overrides)


def parse_flags(schema, argv: list[str], description: str, flags: dict[str, str],
                switches: dict[str, str] | None = None):
    """`--config FILE`, `--flag VALUE` for each of `flags` (flag -> config key), boolean
    `switches` (flag -> "key=value" they set), then `key=value` overrides, which win."""
    switches = switches or {}
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config")
    for flag in flags:
        parser.add_argument(flag)
    for flag in switches:
        parser.add_argument(flag, action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = vars(parser.parse_args(argv))
    dest = lambda flag: flag[2:].replace("-", "_")  # noqa: E731
    overrides = [f"{key}={args[dest(flag)]}" for flag, key in flags.items() if args[dest(flag)] is not None]
    overrides += [kv for flag, kv in switches.items() if args[dest(flag)]]
    return load_config(schema, args["config"], overrides + args["overrides"])


def one_line_errors(fn):
    """Run `fn`; a DraftsmithError becomes `error: <message>` on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DraftsmithError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper


def load_proposer(path: str, target, draft_sampling: str = "greedy", seed: int = 0):
    """A trained draft folder or an export (BF16, or FP8 simulated) -> (its in-tree proposer,
    a description), through the draft registry."""
    import json
    from pathlib import Path

    from export import formats
    from trainer.drafts import get, load_draft

    if not Path(path).is_dir():
        raise DraftsmithError(f"draft '{path}' is neither 'ngram', a trained draft folder nor an export")
    if (Path(path) / formats.EXPORT_MANIFEST).is_file():
        manifest = json.loads((Path(path) / formats.EXPORT_MANIFEST).read_text())
        kind = f"FP8 {manifest['quantization']['scheme']}" if manifest.get("quantization") else manifest["dtype"]
        algorithm, draft = formats.load_export(path, target)
        name = f"{algorithm} {kind} ({path})"
    else:
        algorithm, draft = load_draft(path, target)
        name = f"{algorithm} ({path})"
    return get(algorithm).Proposer(draft, draft_sampling=draft_sampling, seed=seed), name

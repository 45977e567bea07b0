"""A setting written once: its default, its help and its bounds where the field is declared
(`setting`), as transformers' configuration classes and vLLM's config dataclasses keep them. From
there come the bounds check every config load runs before a schema's cross-field `validate()`
(`check_settings`), the help of every command-line flag and of the unknown-key suggestions
(`help_of`), and the generated reference page, docs/config.md (`reference_page`, written by
scripts/config_reference.py).
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

from omegaconf import MISSING

from trainer.errors import ConfigError

_NO_DEFAULT = object()


def setting(default: Any = _NO_DEFAULT, help: str = "", *, factory: typing.Callable[[], Any] | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            choices: typing.Sequence[Any] | None = None) -> Any:
    """A dataclass field with its help and its bounds: `ge`/`gt`/`le`/`lt` (numbers; for a list or a
    dict, each element or value), `choices` (the values allowed). A null value of an optional field
    is never checked (null means "the default behaviour", which the help says). `factory` for a
    list or dict default; no default (MISSING): the key is required."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if choices is not None:
        bounds["choices"] = tuple(choices)
    metadata = {"help": help, "bounds": bounds}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=MISSING if default is _NO_DEFAULT else default, metadata=metadata)


def rule(bounds: dict) -> str:
    """The bounds as the words an error and the reference use: ">= 1", "in (0, 1]", "one of a, b"."""
    if "choices" in bounds:
        return "one of " + ", ".join(str(c) for c in bounds["choices"])
    low = (f"[{bounds['ge']:g}" if "ge" in bounds else f"({bounds['gt']:g}" if "gt" in bounds else None)
    high = (f"{bounds['le']:g}]" if "le" in bounds else f"{bounds['lt']:g})" if "lt" in bounds else None)
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return ""


def brief(text: str, width: int = 100) -> str:
    """A help whole when it is short (at most `width` characters), else its first clause (up to its first
    "; ", ": " or " (", past an engine's tag such as "vllm: "), cut to `width`: what an error line and a
    suggestion quote of it."""
    if len(text) <= width:
        return text
    cut = min((k for k in (text.find("; ", 6), text.find(": ", 6), text.find(" (", 6)) if k > 0), default=len(text))
    text = text[:cut]
    return text if len(text) <= width else text[:text.rfind(" ", 0, width - 3)] + "..."


def _fits(value: Any, bounds: dict) -> bool:
    if "choices" in bounds:
        return value in bounds["choices"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True  # a type OmegaConf checked already: bounds are for numbers
    return (value >= bounds.get("ge", value) and value <= bounds.get("le", value)
            and ("gt" not in bounds or value > bounds["gt"]) and ("lt" not in bounds or value < bounds["lt"]))


def check_settings(obj: Any, prefix: str = "") -> None:
    """Every field of a config (nested sections too) within its declared bounds: one line naming
    the key, the value, what to use and the setting's help."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        bounds = f.metadata.get("bounds") or {}
        if bounds and value is not None:
            items = list(value.items()) if isinstance(value, dict) else \
                [(None, v) for v in value] if isinstance(value, list) else [(None, value)]
            bad = next(((k, v) for k, v in items if not _fits(v, bounds)), None)
            if bad is not None:
                k, v = bad
                where = f"{k}: " if k is not None else ""
                shown = _show(value) if v is value else f"{_show(value)} ({where}{_show(v)})"
                null = ", or null" if _optional(f) else ""
                said = brief(f.metadata.get("help", ""))
                raise ConfigError(f"{prefix}{f.name}={shown}; use {rule(bounds)}{null}"
                                  + (f" ({said})" if said else ""))
        check_settings(value, f"{prefix}{f.name}.")


def _show(value: Any) -> str:
    """A value as given in YAML: {key: 1}, [1, 4], 0.5, 'text'."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def _optional(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def _nested(f: dataclasses.Field) -> type | None:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return type(default) if dataclasses.is_dataclass(default) else None


def help_of(schema: type, dotted: str) -> str:
    """The help of a (dotted) key of `schema`; "" where it has none."""
    *parents, last = dotted.split(".")
    for part in parents:
        f = {f.name: f for f in dataclasses.fields(schema)}.get(part) if dataclasses.is_dataclass(schema) else None
        schema = _nested(f) if f is not None else None
        if schema is None:
            return ""
    f = {f.name: f for f in dataclasses.fields(schema)}.get(last) if dataclasses.is_dataclass(schema) else None
    return f.metadata.get("help", "") if f is not None else ""


def reference(schema: type, prefix: str = "") -> list[dict]:
    """Every key of `schema` (nested sections flattened, dotted): its type, default, bounds and help."""
    rows = []
    for f in dataclasses.fields(schema):
        sub = _nested(f)
        if sub is not None:
            rows += reference(sub, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append({"key": f"{prefix}{f.name}", "type": kind, "default": "required" if default == MISSING else default,
                     "rule": rule(f.metadata.get("bounds") or {}), "help": f.metadata.get("help", "")})
    return rows


def _yaml(value: Any) -> str:
    """A default as YAML writes it: null, true, 0.0001, [1, 4, 16], text."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else _show(value)


def reference_page(schemas: dict[str, type], width: int = 110) -> str:
    """docs/config.md: per stage, every key (nested sections dotted) with its type, default, bounds and
    help, as the schemas declare them (`scripts/config_reference.py` writes it; tests/test_docs.py
    fails when it is stale)."""
    lines = ["# Settings reference", "",
             "Generated from the schemas (`trainer/config/*.py`, each setting's default, bounds and help declared",
             "with it): `.venv/bin/python scripts/config_reference.py` rewrites this page. Set any key in the",
             "stage's YAML (`--config FILE`) or as `key=value` after the command (nested keys dotted:",
             "`regenerate.enabled=true`); the draft's section as `draft.KEY=VALUE` to train, under the algorithm",
             "chosen ([train](train.md#the-draft-section)).", ""]
    for stage, schema in schemas.items():
        lines += [f"## {stage}", ""]
        rows = reference(schema)
        sections = sorted({r["key"].split(".")[0] for r in rows if r["key"].split(".")[0] in schemas} - {stage})
        if sections:  # the demo's stage sections: the stages' own settings, listed under them
            lines += [", ".join(f"`{x}.*`" for x in sections) + ": the settings of those stages, above.", ""]
        for row in rows:
            if row["key"].split(".")[0] in sections:
                continue
            kind = row["type"].replace(" | None", " or null").replace(" | ", " or ")
            default = "required" if row["default"] == "required" else f"default `{_yaml(row['default'])}`"
            head = f"- `{row['key']}` ({kind}, {default}" + (f", {row['rule']}" if row["rule"] else "") + "): "
            lines += textwrap.wrap(head + " ".join(row["help"].split()), width, subsequent_indent="  ",
                                   break_on_hyphens=False, break_long_words=False)
        lines.append("")
    return "\n".join(lines).rstrip("\n")

"""Loading a typed run config: dataclass defaults <- YAML file <- `key=value` overrides.

OmegaConf structured configs do the merging and type checks; this module turns their
exceptions into one line that names the key and says how to fix it: unknown keys get a "did
you mean" suggestion, wrong types name the expected type, missing required fields are listed.
Each setting's bounds are declared with it (trainer/settings.py `setting`) and checked at load time,
before the cross-field checks of each schema's `validate()` method (the stage modules beside
this one).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError
from trainer.settings import brief, check_settings, help_of

T = TypeVar("T")


def _field_types(schema: type) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(schema)}


def _nested_schema(f: dataclasses.Field) -> type | None:
    t = f.type
    if isinstance(t, str):  # postponed annotations: resolve through the default
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        return type(default) if dataclasses.is_dataclass(default) else None
    return t if dataclasses.is_dataclass(t) else None


def _check_keys(schema: type, data: Any, where: str, prefix: str = "") -> None:
    """Reject keys the schema does not have, with the closest valid key as a hint."""
    if not isinstance(data, dict):
        return
    fields = _field_types(schema)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            said = brief(help_of(schema, close[0])) if close else ""
            hint = (f"; did you mean '{prefix}{close[0]}'" + (f" ({said})?" if said else "?") if close
                    else f"; valid keys: {', '.join(sorted(fields))}")
            raise ConfigError(f"{where}: unknown key '{full}' for {schema.__name__}{hint}")
        sub = _nested_schema(fields[key])
        if sub is not None:
            _check_keys(sub, value, where, prefix=f"{full}.")


def _field_type(schema: type, dotted: str) -> str | None:
    """The annotation (as written) of a dotted key of `schema`, None where it is not a
    dataclass field (a free-form section such as train.draft)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        f = _field_types(schema).get(part) if dataclasses.is_dataclass(schema) else None
        if f is None:
            return None
        if i == len(parts) - 1:
            return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        schema = _nested_schema(f)
    return None


def _parse_overrides(overrides: list[str], schema: type) -> dict:
    """`key=value` items -> a nested dict. Values are YAML (numbers, booleans, lists), except
    for string fields, which take the text as it is (a Jinja template, a path with brackets,
    "true"); `null` still unsets an optional string. A value that is not YAML for a field
    that is not a string is one line naming the key."""
    out: dict = {}
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not key=value (e.g. batch_size=8 or capture.dtype=bf16)")
        key, raw = item.split("=", 1)
        kind = _field_type(schema, key)
        if kind in ("str", "str | None"):
            value = None if kind == "str | None" and raw in ("null", "~", "None") else raw
        elif kind == "Any":  # a string or a structure (prepare's source: a path or a mixture list)
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError as err:
                first = str(err).splitlines()[0]
                raise ConfigError(f"override '{key}': value {raw!r} is not valid YAML ({first}); quote it or fix "
                                  "its syntax") from None
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{key}' conflicts with another override of '{part}'")
        node[last] = value
    return out


def _merge(base: DictConfig, data: dict, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, data)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"{where}: key '{key}': {msg}") from None


def check_finite(obj: Any, prefix: str = "") -> None:
    """Every float field of a config (nested ones too) is a finite number: NaN passes every
    comparison a bound makes (`x < 0` is False), and inf is never a setting. One line naming the key."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name}={value} is not a finite number; give a real value")
        check_finite(value, f"{prefix}{f.name}.")


_HOME = re.compile(r"~[^/\s]*(/|$)")  # `~` or `~user`, then a separator or the end


def expand_home(obj: Any) -> None:
    """Expand a leading `~` (as a shell would) in every string field of a config, nested ones
    and lists too, in this one place: a path given quoted, from YAML or from zsh means the same
    folder to the stage that reads it and to the one that writes it. `jsonl:~/x` keeps its prefix."""
    if not dataclasses.is_dataclass(obj):
        return

    def expand(value):
        if isinstance(value, str):
            prefix, _, rest = value.partition(":") if value.startswith(("jsonl:", "json:")) else ("", "", value)
            if _HOME.match(rest):
                rest = os.path.expanduser(rest)
            return f"{prefix}:{rest}" if prefix else rest
        if isinstance(value, list):
            return [expand(v) for v in value]
        if isinstance(value, dict):
            return {k: expand(v) for k, v in value.items()}
        expand_home(value)
        return value

    for f in dataclasses.fields(obj):
        setattr(obj, f.name, expand(getattr(obj, f.name)))


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build a `schema` instance from its defaults, an optional YAML file and overrides."""
    cfg: DictConfig = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found; pass an existing YAML (see recipes/configs/)")
        try:
            data = OmegaConf.to_container(OmegaConf.load(path)) or {}
        except Exception as err:  # yaml.YAMLError and friends
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"config file '{path}' is not valid YAML: {first}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
        _check_keys(schema, data, str(path))
        cfg = _merge(cfg, data, str(path))
    if overrides:
        data = _parse_overrides(overrides, schema)
        _check_keys(schema, data, "override")
        cfg = _merge(cfg, data, "override")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        where = f" in '{path}'" if path is not None else ""
        raise ConfigError(
            f"required key(s) {', '.join(missing)} not set{where}; set them in the YAML or as key=value overrides"
        )
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{getattr(err, 'full_key', '?')}: {getattr(err, 'msg', err)}") from None
    check_finite(obj)
    check_settings(obj)
    expand_home(obj)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj  # type: ignore[return-value]


def load_section(schema: type[T], data: Any, where: str) -> T:
    """A config section whose schema is chosen at load time (a draft's config, picked by
    `algorithm` through the registry): the same strict keys, types and `validate()`."""
    if dataclasses.is_dataclass(data):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(f"'{where}' must be a mapping of keys, not {type(data).__name__}")
    _check_keys(schema, data, "config", prefix=f"{where}.")
    cfg = _merge(OmegaConf.structured(schema), data, where)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where}.{getattr(err, 'full_key', '?')}: {getattr(err, 'msg', err)}") from None
    check_finite(obj, f"{where}.")
    check_settings(obj, f"{where}.")
    expand_home(obj)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (written beside every stage's output)."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))

"""Reading settings: ``key=value`` words, TOML files and layers of them, typed by the schema.

Precedence (lowest to highest): field defaults, ``--config FILE.toml``, command-line flags,
``key=value`` overrides. Every error names the offending key or value and how to fix it.
"""

from __future__ import annotations

import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nobubble.config.checks import check_schema
from nobubble.config.correction import fold_ef
from nobubble.config.fields import ConfigError, as_bool, suggest
from nobubble.config.schema import FIELDS, HINTS, TrainConfig


def unknown_key_error(key: str) -> ConfigError:
    return ConfigError(
        f"unknown config key {key!r}{suggest(key, FIELDS)}; valid keys: {', '.join(FIELDS)}"
    )


def base_type(hint: Any) -> tuple[Any, bool]:
    """Return (type without None, whether None is allowed)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def coerce(key: str, value: Any) -> Any:
    """Convert ``value`` (from TOML or a ``key=value`` string) to the type of field ``key``."""
    if key not in FIELDS:
        raise unknown_key_error(key)
    hint, nullable = base_type(HINTS[key])
    if isinstance(value, str):
        text = value.strip()
        if nullable and text.lower() in ("none", "null", ""):
            return None
        if hint is str:
            return value
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{key} cannot be empty; give a {hint.__name__}")
    return _check_type(key, hint, value)


def _check_type(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list like [3, 3], got {value!r}")
        return [_check_type(key, item, v) for v in value]
    if hint is bool:
        return as_bool(key, value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be a whole number, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover - programming error


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings (values in TOML syntax, bare strings allowed; the old
    ``ef=true`` read as ``correction=ef``, with a warning: :func:`fold_ef`)."""
    words: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} (e.g. lr=1e-3 or optim=muon)")
        key, value = item.split("=", 1)
        words[key.strip().replace("-", "_")] = value
    return {key: coerce(key, value) for key, value in fold_ef(words, warn=True).items()}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; ``[section]`` headings are allowed and flattened (keys are unique
    over the sections: :data:`nobubble.config.schema.SECTIONS`, so a key set in two tables, or
    spelled with ``-`` and ``_`` in one, is refused; the old ``ef=true`` is read as
    ``correction=ef``, with a warning: :func:`fold_ef`)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}  # the table each key was set in
    for key, value in raw.items():
        table, place = (value, f"[{key}]") if isinstance(value, dict) else ({key: value}, "")
        for sub, subvalue in table.items():  # a [section]: no field is a table
            name = sub.replace("-", "_")
            if name in where:  # TOML refuses a key twice in one table; the sections share keys
                first, second = where[name] or "the top level", place or "the top level"
                raise ConfigError(
                    f"config file {path} sets {name} in {first} and again in {second}; "
                    "keep one of them"
                )
            flat[name], where[name] = subvalue, place
    return {key: coerce(key, value) for key, value in fold_ef(flat, warn=True).items()}


def from_saved(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration saved by any version (a run folder's config.json, a checkpoint's
    meta.json) with every key it lacks set to what it meant when it was saved: the field's
    ``saved_default`` (config/fields.py), so a changed default never changes an earlier run.
    The old spelling ``ef=true`` is read as ``correction=ef``, silently (:func:`fold_ef`). The
    one reading of a saved configuration: resuming, the sweep and the report all call it."""
    defaults = {key: f.metadata["saved_default"] for key, f in FIELDS.items() if key not in saved}
    return fold_ef({**defaults, **saved}, warn=False)


def merge_layers(*layers: dict[str, Any]) -> TrainConfig:
    """Merge override layers over the defaults and check what the schema alone can check (types,
    ranges, fixed choices, divisibility). What needs a registry (presets, optimizers, schedules,
    corrections) is checked above: :func:`nobubble.configure.build_config`. A layer's old
    ``ef=true`` is read as ``correction=ef`` in that layer, with a warning (:func:`fold_ef`)."""
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in fold_ef(layer, warn=True).items():
            values[key] = coerce(key, value)
    cfg = TrainConfig(**values)
    check_schema(cfg)
    return cfg

"""Loading the config tree (`cluster.config.ServeConfig`) from YAML: `load_config` reads a file,
applies `key.path=value` overrides and typed settings, then builds each section's frozen dataclass,
refusing unknown keys and wrong types. Unknown keys, wrong types and bad values are one clear
`ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml

from cluster.config import ConfigError, ServeConfig
from workers.engine.errors import EngineConfigError


def _check_type(path: str, value, annotation) -> None:
    origin = typing.get_origin(annotation)
    allowed = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    kinds = tuple(float if a is float else a for a in allowed if isinstance(a, type))
    if type(None) in allowed and value is None:
        return
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return
    if not kinds or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
        return
    names = " or ".join(k.__name__ for k in kinds)
    raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {value!r}")


def _build(cls, data, path: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{path + '.' if path else ''}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, key)
        else:
            if name != "eagle_mode":
                _check_type(key, value, hint)
            values[name] = value
    try:
        return cls(**values)
    except (EngineConfigError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        message = str(exc)
        raise ConfigError(message if message.startswith(f"{path}.") else f"{path}: {message}") from None


def _apply_override(data: dict, override: str) -> None:
    """`a.b.c=VALUE` (VALUE parsed as YAML) set into the raw config mapping."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY.PATH=VALUE")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: invalid value: {exc}") from None
    try:
        _set(data, key, value)
    except ConfigError as exc:
        raise ConfigError(f"override {override!r}: {exc}") from None


def _set(data: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a mapping")
    node[leaf] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                settings: dict[str, object] | None = None) -> ServeConfig:
    """Load and validate; `overrides` are `key.path=value` strings applied on top (e.g. `--set`),
    then `settings` (key path -> typed value, e.g. from `vllm serve`-style flags). `path` None:
    the built-in defaults."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for override in overrides:
        _apply_override(data, override)
    for key, value in (settings or {}).items():
        _set(data, key, value)
    return _build(ServeConfig, data, "")

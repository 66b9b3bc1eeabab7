"""Strict dataclass configs: YAML in, `a.b=c` overrides, one-line errors naming key and file.

DeepSpeed and most YAML loaders silently ignore a misspelt key; a recipe that trains the wrong
thing for a day is worse than one that refuses to start. Everything here raises ``ConfigError``
whose message is a single line that names the offending key and the file it came from.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or config file is invalid; the message is one line naming the key and file."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where lossless (int -> float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, src)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{src}: '{key}' expects {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            choices = " | ".join(str(a) for a in args)
            raise ConfigError(f"{src}: '{key}' must be one of {choices}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: '{key}' must be a mapping, got {value!r}")
        return from_dict(tp, value, src=src, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{src}: '{key}' must be a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]", src) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: '{key}' must be a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}", src) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{src}: '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{src}: '{key}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{src}: '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{src}: '{key}' must be a string, got {value!r}")
        return value
    raise ConfigError(f"{src}: '{key}' has unsupported type {_type_name(tp)}")


def from_dict(cls: type[T], data: dict, *, src: str = "<config>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: '{prefix.rstrip('.') or '<root>'}' must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{src}: unknown key '{prefix}{unknown[0]}' (known here: {known})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], prefix + name, src)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{src}: missing required key '{prefix}{name}'")
    try:
        obj = cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{src}: {exc}") from None
    return obj


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (for logging, wandb config, and round trips)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=c`` into (['a', 'b'], value) with the value parsed as YAML (so 3 is an int)."""
    if "=" not in text:
        raise ConfigError(f"command line: override '{text}' is not of the form key=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"command line: override '{text}' has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``a.b=c`` applied (creating nested mappings)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"command line: '{'.'.join(path)}': '{part}' is not a mapping")
            node = child
        node[path[-1]] = value
    return out


def load_json(path: str | Path, error: type[ConfigError] = ConfigError) -> Any:
    """Read a JSON file, with one-line errors (of class ``error``) for a missing or bad file."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: file not found")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise error(f"{p}: not a UTF-8 text file") from None


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with one-line errors for a missing file or bad syntax."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}: invalid YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return data

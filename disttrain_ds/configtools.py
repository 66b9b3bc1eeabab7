"""Strict dataclass configs: YAML in, `a.b=c` overrides, one-line errors naming key and file.

DeepSpeed and most YAML loaders silently ignore a misspelt key; a recipe that trains the wrong
thing for a day is worse than one that refuses to start. Everything here raises ``ConfigError``
whose message is a single line that names the offending key and the file it came from.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from disttrain_ds.errors import ConfigError

T = TypeVar("T")


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
        classes = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(classes) == 1:  # an optional section: keep its own key errors
            return _coerce(value, classes[0], key, src)
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
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{src}: '{key}' must be a finite number, got {value!r}")
        return number
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
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys need not be strings
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
        value = yaml.load(raw, Loader=StrictLoader) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):
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


MAX_YAML_NODES = 100_000
"""Most nodes a YAML document may hold with its aliases expanded (a recipe has a few hundred);
bounds "billion laughs" documents whose nested aliases would expand to billions of nodes."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys (PyYAML keeps the last one silently),
    documents whose aliases expand to more than ``MAX_YAML_NODES`` nodes, and reports a value it
    cannot build (an integer too long to convert) at its line."""

    def compose_node(self, parent, index):
        # Expanded size of each node, bottom up: an alias counts as the whole node it repeats.
        sizes = self.__dict__.setdefault("_expanded", {})
        node = super().compose_node(parent, index)
        if id(node) not in sizes:
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = []
            size = 1 + sum(sizes.get(id(c), 1) for c in children)
            sizes[id(node)] = size
            if size > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"aliases expand to more than {MAX_YAML_NODES} nodes", node.start_mark)
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<' merges are meant to be overridden
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _read_text(p: Path, error: type[ConfigError]) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{p}: not a UTF-8 text file") from None
    except OSError as exc:
        raise error(f"{p}: cannot be read: {exc.strerror or exc}") from None


def load_json(path: str | Path, error: type[ConfigError] = ConfigError) -> Any:
    """Read a JSON file, with one-line errors (of class ``error``) for a missing or bad file."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: file not found")
    text = _read_text(p, error)
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise error(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except _DuplicateKey as exc:
        raise error(f"{p}: duplicate key '{exc.key}'") from None
    except RecursionError:
        raise error(f"{p}: invalid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer too long to convert
        raise error(f"{p}: invalid JSON: {exc}") from None


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with one-line errors for a missing file or bad syntax."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: file not found")
    text = _read_text(p, ConfigError)
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        position = getattr(exc, "position", None)  # reader errors (control characters) have no mark
        line = mark.line + 1 if mark else text.count("\n", 0, position) + 1 if isinstance(position, int) else None
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None)
        where = f" at line {line}" if line else ""
        raise ConfigError(f"{p}: invalid YAML{where}" + (f": {problem}" if problem else "")) from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid YAML: nested too deeply") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return data

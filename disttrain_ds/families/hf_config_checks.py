"""Checks every family's ``config.json`` reader shares: what the file must hold, and the settings
a family builds with fixed, refused in one line when a checkpoint says otherwise. No torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from disttrain_ds.errors import ConfigError


def require_kind(hf: Mapping[str, Any], key: str, kinds: tuple[str, ...], where: str) -> None:
    """``hf[key]`` (``model_type`` or diffusers' ``_class_name``) names a model this family reads."""
    if hf.get(key) not in kinds:
        raise ConfigError(f"{where}: '{key}' is {hf.get(key)!r}; this family reads {' | '.join(kinds)} checkpoints")


def require_positive_ints(hf: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    """Each of ``keys`` is in ``hf`` as a positive integer (a size the family's shapes come from)."""
    for key in keys:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: '{key}' must be a positive integer, got {value!r}")


def refuse_other_settings(hf: Mapping[str, Any], fixed: Mapping[str, Any], where: str, model: str) -> None:
    """Each setting in ``fixed`` is absent from ``hf`` or has the value the family builds ``model``
    with (a list of one value per level counts as that value)."""
    for key, value in fixed.items():
        given = hf.get(key, value)
        if isinstance(given, list) and given and all(v == value for v in given):
            given = value
        if given != value:
            raise ConfigError(f"{where}: '{key}' is {hf[key]!r}; this family builds {model} with {value!r} "
                              "(not reproduced)")

"""Model families as plug-ins: one folder each, one line each in ``FAMILIES``.

To add a family, write ``families/<name>/`` (its layers and a ``FAMILY = Family(...)`` record,
see ``base.py``) and list it below; recipes then pick it with ``model.<module>.family``.
"""

from __future__ import annotations

import sys
from typing import Any

from disttrain_ds.errors import ConfigError
from disttrain_ds.families import clip, dit, llama, qwen2, siglip, unet, vit, whisper
from disttrain_ds.families.base import BuildContext, Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    vit.FAMILY,
    clip.FAMILY,
    siglip.FAMILY,
    whisper.FAMILY,
    llama.FAMILY,
    qwen2.FAMILY,
    unet.FAMILY,
    dit.FAMILY,
)}

DEFAULT_FAMILY = {"encoder": "vit", "llm": "llama", "generator": "unet"}
"""The family a module of each role has when its recipe section names none."""


def default_config(role: str) -> Any:
    """A section of ``role``'s default family at its defaults (the three-module form's section when
    the recipe leaves it out; a stand-in module's sizes where a graph has none of that role)."""
    return FAMILIES[DEFAULT_FAMILY[role]].config_type()


def family_names(role: str) -> list[str]:
    return [n for n, f in FAMILIES.items() if f.role == role]


def get_family(name: str, role: str, src: str = "<recipe>", key: str = "model.family") -> Family:
    """The family ``name`` for a module of ``role``; a one-line ConfigError naming ``key`` otherwise."""
    fam = FAMILIES.get(name) if isinstance(name, str) else None  # a mapping or list is no name (unhashable)
    if fam is None or fam.role != role:
        raise ConfigError(f"{src}: '{key}' must be one of {' | '.join(family_names(role))} (the {role} families), "
                          f"got {name!r}")
    return fam


def tp_plans() -> list[tuple[type, Any]]:
    """The tensor-parallel plan entries of the families whose network code this process has
    imported: no layer of another family can exist here, so sharding imports nothing (a rank of
    the LLM never loads diffusers)."""
    return [entry for f in FAMILIES.values() if f.model in sys.modules for entry in f.tp_plan()]


def clear_build_caches() -> None:
    """Forget the whole models some families build once and take layers from (e.g. after a
    build on the meta device); only families already imported are touched."""
    for f in FAMILIES.values():
        module = sys.modules.get(f.model)
        if module is not None and hasattr(module, "clear_caches"):
            module.clear_caches()


__all__ = ["FAMILIES", "DEFAULT_FAMILY", "BuildContext", "Family", "clear_build_caches", "default_config", "family_names",
           "get_family", "tp_plans"]

"""A module's shapes and settings read from its checkpoint's ``config.json``.

With ``model.<module>.checkpoint`` a save_pretrained directory, the family reads the directory's
``config.json`` (``Family.checkpoint_fields``): fields the recipe leaves out take the checkpoint's
values (over the preset's), a field the recipe writes differently stops the load in one line
naming both values, and a setting the family cannot reproduce is refused by the family.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disttrain_ds.errors import ConfigError
from disttrain_ds.families.base import Family


def checkpoint_fields(fam: Family, section: dict[str, Any], key: str, src: str) -> dict[str, Any]:
    """The fields ``<section.checkpoint>/config.json`` fixes for a module of ``fam`` at recipe key
    ``key`` ({} without such a file, or for a family that reads none)."""
    ckpt = section.get("checkpoint")
    if fam.checkpoint_fields is None or not isinstance(ckpt, str) or not ckpt:
        return {}
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        return {}
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{src}: '{key}.checkpoint': {path} is not a readable JSON file "
                          f"({' '.join(str(exc).split())})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{src}: '{key}.checkpoint': {path} does not hold a JSON object")
    try:
        fields = fam.checkpoint_fields(hf, str(path))
    except ConfigError as exc:
        raise ConfigError(f"{src}: '{key}.checkpoint': {exc}") from None
    for name, value in fields.items():
        if name in section and section[name] != value:
            raise ConfigError(f"{src}: '{key}.{name}' is {section[name]!r} but its checkpoint says {value!r} "
                              f"({path}); leave it out to take the checkpoint's")
    return fields

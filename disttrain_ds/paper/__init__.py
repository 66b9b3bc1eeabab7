"""The DistTrain paper's published figures, shipped with the package.

``disttrain_paper.json`` beside this module holds the model table, the Fig. 3 forward-time
profile, the Fig. 5 LAION-400M statistics and the evaluation figures (Fig. 15-19, 21, Table 2) of
Zhang et al., *DistTrain: Addressing Model and Data Heterogeneity with Disaggregated Training for
Multimodal Large Language Models*, SIGCOMM '25, arXiv 2408.04275. ``SOURCES.md`` beside it says
which figure or table each key comes from. :func:`load_paper_figures` reads it (or another copy).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from disttrain_ds.errors import ConfigError

PAPER_FILE = "disttrain_paper.json"
"""File name of the packaged figures inside ``disttrain_ds.paper``."""


def packaged_figures_name() -> str:
    """How the packaged figures file is named in messages (its path where it is a plain file)."""
    return str(resources.files(__name__).joinpath(PAPER_FILE))


def _read(path: str | Path | None) -> tuple[str, str]:
    """(name for messages, text) of the packaged file or of ``path``; ConfigError if unreadable."""
    if path is None:
        name, res = packaged_figures_name(), resources.files(__name__).joinpath(PAPER_FILE)
    else:
        name, res = str(path), Path(path).expanduser()
    try:
        return name, res.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: paper figures file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{name}: is a directory, not the paper figures JSON file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not UTF-8 text (expected the paper figures JSON)") from None
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the paper figures ({exc.strerror or exc})") from None


def _parse(name: str, text: str) -> dict[str, Any]:
    """The JSON object in ``text``; ConfigError naming ``name`` if it is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a JSON object of the paper's figures, got {type(data).__name__}")
    return data


def load_paper_figures(path: str | Path | None = None) -> dict[str, Any]:
    """The paper's figures: the packaged copy, or the JSON file at ``path`` when one is given.

    A file given by ``path`` must hold every top-level key of the packaged copy (its values may
    differ). Any problem is a one-line ``ConfigError`` naming the file.
    """
    packaged = _parse(*_read(None))
    if path is None:
        return packaged
    name, text = _read(path)
    data = _parse(name, text)
    missing = [k for k in packaged if not k.startswith("_") and k not in data]
    if missing:
        raise ConfigError(f"{name}: missing '{missing[0]}' ({len(missing)} of the paper figures' "
                          f"{sum(not k.startswith('_') for k in packaged)} keys absent)")
    return data

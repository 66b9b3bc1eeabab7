"""Source names -> source objects, with the default fixture locations and the synthetic fallback."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from .config import SOURCES, DataConfig
from .source import SampleSource, ShapeSpec, SyntheticSource

log = logging.getLogger(__name__)

DEFAULT_FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
"""Where mmc4 and laion read when ``data.path`` is empty: ``<repo>/../shared/fixtures``."""

DEFAULT_FILES = {"mmc4": "mmc4_sample.jsonl", "laion": "laion_captions.jsonl"}

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def resolve(cfg: DataConfig, fixtures: Path | None = None) -> DataConfig:
    """``cfg`` with its path filled in; synthetic (and one warning) when the default data is absent.

    Resolved once in the trainer, so producer processes neither search again nor warn again.
    """
    if cfg.source not in SOURCES:
        raise ValueError(f"data.source: must be one of {' | '.join(SOURCES)}, got {cfg.source!r}")
    if cfg.source == "local" and not cfg.path:
        raise ValueError("data.path: the local source needs a file or folder of records")
    if cfg.source not in DEFAULT_FILES or cfg.path:
        return cfg
    default = (fixtures or DEFAULT_FIXTURES) / DEFAULT_FILES[cfg.source]
    if default.is_file():
        return dataclasses.replace(cfg, path=str(default))
    _warn_once(f"data.source: {cfg.source} data not found at {default}; using the synthetic source instead")
    return dataclasses.replace(cfg, source="synthetic")


def open_source(cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int) -> SampleSource:
    """The in-process source for a resolved ``cfg`` (see :func:`resolve`)."""
    if cfg.source == "synthetic":
        return SyntheticSource(cfg, shape, global_batch, seed)
    if cfg.source == "paper_stats":
        from .paper_source import PaperStatsSource

        return PaperStatsSource(cfg, shape, global_batch, seed)
    if cfg.source in ("mmc4", "laion", "local"):
        from .record_source import RecordSource

        return RecordSource(cfg, shape, global_batch, seed, cfg.source, Path(cfg.path).expanduser())
    raise ValueError(f"data.source: must be one of {' | '.join(SOURCES)}, got {cfg.source!r}")

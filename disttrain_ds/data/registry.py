"""Source names -> source objects; real-record sources read ``data.path`` and nothing else."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from disttrain_ds.data.config import SOURCES, DataConfig, path_problem
from disttrain_ds.data.latent_source import LatentSource
from disttrain_ds.data.paper_source import PaperStatsSource
from disttrain_ds.data.record_source import RecordSource
from disttrain_ds.data.shard_source import open_shard_source
from disttrain_ds.data.source import SampleSource, SyntheticSource
from disttrain_ds.data.split import TRAIN, Split
from disttrain_ds.samples import ShapeSpec


def resolve(cfg: DataConfig) -> DataConfig:
    """``cfg`` checked for a known source and, for the sources that read files, a ``data.path``.

    Checked once in the trainer before producer processes start. Nothing falls back: a real-data
    source without a path is a one-line ``ValueError`` naming ``data.path``.
    """
    if cfg.source not in SOURCES:
        raise ValueError(f"data.source: must be one of {' | '.join(SOURCES)}, got {cfg.source!r}")
    problem = path_problem(cfg)
    if problem:
        raise ValueError(f"data.path: {problem}")
    return cfg


def open_source(cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, split: Split = TRAIN) -> SampleSource:
    """The in-process source for a resolved ``cfg`` (see :func:`resolve`), reading ``split``."""
    if shape.vae is not None:  # RGB targets from the source below, latents out
        return LatentSource(open_source(cfg, replace(shape, vae=None), global_batch, seed, split), shape.vae, seed)
    if cfg.source == "synthetic":
        return SyntheticSource(cfg, shape, global_batch, seed, split)
    if cfg.source == "paper_stats":
        return PaperStatsSource(cfg, shape, global_batch, seed, split)
    if cfg.source in ("mmc4", "laion", "local"):
        return RecordSource(cfg, shape, global_batch, seed, cfg.source, Path(cfg.path).expanduser(), split)
    if cfg.source in ("webdataset", "parquet", "folder", "hf"):
        return open_shard_source(cfg, shape, global_batch, seed, split)
    raise ValueError(f"data.source: must be one of {' | '.join(SOURCES)}, got {cfg.source!r}")

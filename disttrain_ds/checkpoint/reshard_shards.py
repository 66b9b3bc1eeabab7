"""Loading a verified checkpoint into engines of another layout (``Checkpointer`` calls these).

A module whose engine files fit this run's engine as they are (same stages, layers, DP and TP
degrees and optimizer kind) is loaded by DeepSpeed, bit for bit as before. Any other module is
re-sharded (``reshard.py``): every rank reads the saved shards of the layers it now holds, joins
them into full tensors and keeps its own shards. Files are read only if the manifest lists them
with their size on disk, and only as plain tensors and containers.
"""

from __future__ import annotations

import os
from pathlib import Path

from disttrain_ds.checkpoint.engine import DEEPSPEED_TYPES
from disttrain_ds.checkpoint.files import CheckpointFileError, safe_load
from disttrain_ds.checkpoint.reshard import (
    describe_rank,
    files_fit,
    fill_tied,
    load_into_engine,
    read_module,
    restore_schedule,
    scheduler_state,
    tied_layers,
)
from disttrain_ds.recipe.graph import topology_of


def must_reshard(ckpt, manifest: dict) -> bool:
    """Whether this rank's module has to be re-sharded: some rank of it finds that the saved engine
    files are not what its engine would have written (``files_fit``). A checkpoint without shard
    records was written by this very layout (the manifest's fingerprint check ensures it)."""
    saved = manifest.get("shards")
    fits = True
    if isinstance(saved, dict):
        grid = topology_of(ckpt.recipe).module(ckpt.module)
        mine = describe_rank(ckpt.engine.module, ckpt.engine.optimizer, grid.data_coords(ckpt.rank),
                             (grid.pp, grid.data_size, grid.tp), [])
        # DeepSpeed 0.19.8 cannot read its own bf16-optimizer files back under ZeRO stage 0 (it looks
        # for the optimizer in the model-state file: KeyError 0), so those are always re-sharded.
        fits = files_fit(saved.get(ckpt.module, []), mine) and mine["optimizer"] != "bf16"
    return not all(ok for m, ok in ckpt._gather((ckpt.module, fits)) if m == ckpt.module)


def reader(path: Path, manifest: dict):
    """Reads a manifest-listed file of the step directory as plain tensors and containers."""
    files = manifest["files"]

    def load(rel: str):
        entry = files.get(rel)
        if entry is None:
            raise CheckpointFileError(f"checkpoint file {path / rel} is not listed in the checkpoint's manifest; refused to load it")
        if os.path.getsize(path / rel) != entry["size"]:
            raise CheckpointFileError(f"checkpoint file {path / rel} is not the size the manifest says")
        return safe_load(path / rel, map_location="cpu", allowed=DEEPSPEED_TYPES)

    return load


def load_resharded(ckpt, path: Path, manifest: dict) -> list[str]:
    """Load this rank's shards of its module from ``path`` (written by another layout); returns
    what was set."""
    pm, grid = ckpt.engine.module, topology_of(ckpt.recipe).module(ckpt.module)
    records = manifest["shards"].get(ckpt.module, [])
    load = reader(path, manifest)
    ties = getattr(pm, "tied_names", {})
    layers = tied_layers(ties, set(range(pm._local_start, pm._local_stop)))
    full = read_module(ckpt.module, sorted(manifest["files"]), records, load, layers)
    fill_tied(full, ties)
    _, _, tp_rank = grid.coords(ckpt.rank)
    done = load_into_engine(ckpt.engine, pm, full, tp_rank, grid.tp)
    restore_schedule(ckpt.engine, scheduler_state(ckpt.module, records, load))
    return done


def resume_line(path: Path, step: int, moved: list[str], loaded: list[tuple[str, list[str]]]) -> str:
    """The one line that tells the user what a resume under another layout did."""
    per_module: dict[str, set[str]] = {}
    for module, done in loaded:
        if done:
            per_module.setdefault(module, set()).update(done)
    what = "; ".join(f"{m}: {', '.join(sorted(d))}" for m, d in per_module.items()) or "nothing (every module's files fit as they are)"
    if not moved:  # same layout, files DeepSpeed cannot read back itself (bf16 optimizer)
        return f"train.resume: read {path} through re-sharding: {what}"
    return (f"train.resume: layout changed since {path} ({'; '.join(moved)}); re-sharded {what}; "
            f"LR schedule and data order continue at step {step}; per-rank RNG states not restored")

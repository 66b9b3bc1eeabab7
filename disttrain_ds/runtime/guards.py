"""Checks that stop a job early with one line: a loss that is not finite, output directories
that cannot be written, and too little disk space for one checkpoint.

The directory and disk checks run before any process group starts (``runtime/entry.py``); the loss check
runs after every step on the record every rank holds, so every rank stops at the same step.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from disttrain_ds.errors import ConfigError, TrainingDiverged


def check_finite_loss(rec: dict, step: int, policy: str = "stop") -> None:
    """Raise ``TrainingDiverged`` when a loss in step record ``rec`` is not finite (policy ``stop``)."""
    if policy != "stop":
        return
    bad = {k: rec[k] for k in ("loss", "loss/lm", "loss/gen") if k in rec and not math.isfinite(rec[k])}
    if bad:
        parts = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise TrainingDiverged(
            f"loss is not finite at step {step} ({parts}); stopped before saving it "
            "(lower optim.lr, set optim.grad_clip or add warm-up; train.on_nonfinite=continue trains on)")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (stops at the root)."""
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def check_writable_dir(path: str | Path, key: str, src: str) -> None:
    """Refuse, with one line naming ``key`` and the directory, a directory that cannot be created
    or written. Nothing is created: the closest existing ancestor is checked by creating (and
    removing) a temporary file in it, which also catches read-only file systems and root."""
    target = Path(path).absolute()
    anchor = _nearest_existing(target)
    if not anchor.is_dir():
        raise ConfigError(f"{src}: '{key}' {path} cannot be created: {anchor} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=anchor, prefix=".disttrain-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{src}: '{key}' {path} is not writable ({anchor}: {exc.strerror or exc})") from None


def checkpoint_bytes(recipe, rows) -> float:
    """Estimated bytes of one checkpoint: weights and optimizer states of every stage, counted once
    per tensor-parallel shard (DP replicas save one copy) and per DP shard where the optimizer is
    sharded (ZeRO-1, bf16), from the memory estimate's per-rank figures (``estimate/memory.py``)."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.memory import state_bytes

    total = 0.0
    for row in rows:
        tp = 1 if recipe.layout == "reference" else recipe.parallel.modules[row.module].tp
        if recipe.layout == "monolithic":
            tp = recipe.parallel.llm.tp
        tp = max(1, min(tp, len(row.ranks)))
        sharded = state_bytes(recipe, row.module)[3]
        total += row.weights * tp + row.optimizer * (len(row.ranks) if sharded else tp)
    return total


def check_disk_space(path: str | Path, need_bytes: float, key: str, src: str) -> None:
    """Refuse, with one line, a directory whose file system has less free space than ``need_bytes``."""
    anchor = _nearest_existing(Path(path).absolute())
    free = shutil.disk_usage(anchor).free
    if free < need_bytes:
        raise ConfigError(
            f"{src}: '{key}' {path} has {free / 2**30:.2f} GiB free but one checkpoint needs an estimated "
            f"{need_bytes / 2**30:.2f} GiB (weights and optimizer states); free space or choose another {key}")


def check_output_dirs(recipe, rows=None) -> None:
    """Before training: ``logging.dir`` and, with checkpoints on, ``checkpoint.dir`` are writable,
    and the checkpoint directory has room for one checkpoint (``rows``: the memory estimate)."""
    # deferred: loads torch
    from disttrain_ds.checkpoint.manifest import checkpoint_root

    src = recipe.source_file or "<recipe>"
    run_dir = recipe.logging.dir or str(Path("runs") / recipe.name)
    check_writable_dir(run_dir, "logging.dir", src)
    if recipe.layout == "reference" or recipe.checkpoint.every <= 0:
        return
    root = checkpoint_root(recipe)
    check_writable_dir(root, "checkpoint.dir", src)
    if rows is None:
        # deferred: loads torch (safetensors too)
        from disttrain_ds.estimate.memory import estimate

        rows = estimate(recipe)
    check_disk_space(root, checkpoint_bytes(recipe, rows), "checkpoint.dir", src)


def fresh_path(path: str | Path) -> Path:
    """``path`` if nothing is there, else the first free ``<stem>-2<suffix>``, ``-3``, ...: an
    end-of-run file of a relaunched run never replaces the one an earlier launch wrote."""
    p = Path(path)
    n = 1
    candidate = p
    while os.path.lexists(candidate):
        n += 1
        candidate = p.with_name(f"{p.stem}-{n}{p.suffix}")
    return candidate

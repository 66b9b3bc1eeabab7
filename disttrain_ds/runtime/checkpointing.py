"""Checkpoints of a pipeline layout: every module engine, the data order and RNG states, at one step.

Layout of ``checkpoint.dir``::

    step_00000300/
        encoder/ llm/ generator/    one DeepSpeed checkpoint per module engine (tag = module name)
        rng/rank00000.pt ...        each rank's RNG states
        data.pt                     the sample source's state (cursor, skip counts)
        manifest.json               written last: step, layout, run directory, files

A step is written into ``step_XXXXXXXX.partial`` and renamed once every rank has finished and the
manifest is on disk, so a directory named ``step_XXXXXXXX`` with a manifest is always complete; a
crash mid-save leaves only a ``.partial`` directory that resuming ignores. Complete checkpoints are
never written over: pruning renames a directory away before deleting it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist

from ..config import Recipe
from ..configtools import ConfigError, to_dict

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_root(recipe: Recipe) -> Path:
    return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else Path("checkpoints") / recipe.name


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def read_manifest(path: Path) -> dict | None:
    """The manifest of a complete checkpoint directory, or None if it is not one."""
    m = _STEP_DIR.match(path.name)
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not m or not isinstance(data, dict) or data.get("step") != int(m.group(1)) or data.get("format") != FORMAT:
        return None
    return data


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        man = read_manifest(d) if d.is_dir() else None
        if man is not None:
            found.append((man["step"], d))
    return sorted(found)


def fingerprint(recipe: Recipe, world: int) -> dict:
    """What a checkpoint must agree with to be resumed: model, data, batch and rank layout."""
    r = to_dict(recipe)
    return {
        "world_size": world,
        "layout": recipe.layout,
        "seed": recipe.seed,
        "model": r["model"],
        "data": r["data"],
        "parallel": {m: r["parallel"][m] for m in ("encoder", "llm", "generator")},
        "train.global_batch": recipe.train.global_batch,
        "train.micro_batch": recipe.train.micro_batch,
        "train.dtype": recipe.train.dtype,
        "optim.name": recipe.optim.name,
    }


def _first_difference(a, b, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
            if d:
                return d
        return None
    return None if a == b else f"{prefix} (checkpoint: {a!r}, this run: {b!r})"


def resolve_resume(recipe: Recipe, world: int) -> tuple[Path | None, dict | None]:
    """The checkpoint this run starts from (``train.resume``), checked against the recipe."""
    src, mode, root = recipe.source_file, recipe.train.resume, checkpoint_root(recipe)
    if mode == "none":
        existing = complete_checkpoints(root)
        if existing and recipe.checkpoint.every:
            raise ConfigError(
                f"{src}: 'checkpoint.dir' {root} already holds checkpoints (newest: step {existing[-1][0]}); "
                "set train.resume=auto to continue that run, or choose another checkpoint.dir"
            )
        return None, None
    if mode == "auto":
        existing = complete_checkpoints(root)
        if not existing:
            return None, None
        path = existing[-1][1]
    else:
        path = Path(mode)
    manifest = read_manifest(path)
    if manifest is None:
        raise ConfigError(f"{src}: 'train.resume' {path} is not a complete checkpoint (no valid {MANIFEST})")
    diff = _first_difference(manifest["fingerprint"], fingerprint(recipe, world))
    if diff:
        raise ConfigError(f"{src}: 'train.resume' {path} was written by a different setup: {diff}")
    later = [s for s, _ in complete_checkpoints(checkpoint_root(recipe)) if s > manifest["step"]]
    if later and recipe.checkpoint.every:
        raise ConfigError(
            f"{src}: 'train.resume' {path} is step {manifest['step']} but {checkpoint_root(recipe)} holds later "
            f"checkpoints (step {later[-1]}) that this run would write over; move them or choose another checkpoint.dir"
        )
    if manifest["step"] > recipe.train.steps:
        raise ConfigError(
            f"{src}: 'train.steps' {recipe.train.steps} is below the checkpoint's step {manifest['step']} ({path})"
        )
    return path, manifest


@dataclass
class Checkpointer:
    """Saves and loads this rank's share of a checkpoint; every rank calls the same methods."""

    recipe: Recipe
    engine: object
    """This rank's ``ModuleEngine``."""
    module: str
    """This rank's module name (the DeepSpeed tag of its engine's files)."""
    rank: int
    world: int
    group: object
    """A gloo group over all ranks for bookkeeping collectives."""

    @property
    def root(self) -> Path:
        return checkpoint_root(self.recipe)

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` optimizer steps."""
        every = self.recipe.checkpoint.every
        return every > 0 and (step % every == 0 or step == self.recipe.train.steps)

    def _agree(self, error: str | None) -> None:
        """Rank 0 tells every rank whether its file-system work succeeded; all fail alike."""
        box = [error]
        tdist.broadcast_object_list(box, src=0, group=self.group)
        if box[0]:
            raise ConfigError(box[0])

    def save(self, step: int, source, run_dir: str) -> Path:
        final = self.root / step_dir_name(step)
        partial = final.with_name(final.name + ".partial")
        error = None
        if self.rank == 0:
            try:
                if final.exists():
                    raise ConfigError(f"checkpoint {final} already exists; it is never written over")
                if partial.exists():  # left by a crash during an earlier save of this step
                    shutil.rmtree(partial)
                (partial / "rng").mkdir(parents=True)
            except (OSError, ConfigError) as exc:
                error = f"checkpoint.dir: cannot write {partial}: {exc}"
        self._agree(error)
        t0 = time.perf_counter()
        # Each engine writes its own tag directory; DeepSpeed's internal barriers span all ranks,
        # which all call this together.
        self.engine.save_checkpoint(str(partial), tag=self.module, client_state={"step": step}, save_latest=False)
        torch.save(rng_state(), partial / "rng" / f"rank{self.rank:05d}.pt")
        if self.rank == 0:
            torch.save({"source": source.state_dict()}, partial / "data.pt")
        tdist.barrier(group=self.group)
        error = None
        if self.rank == 0:
            try:
                self._seal(partial, final, step, run_dir)
                self._prune()
            except OSError as exc:
                error = f"checkpoint.dir: could not complete {final}: {exc}"
        self._agree(error)
        self.seconds = time.perf_counter() - t0
        return final

    def _seal(self, partial: Path, final: Path, step: int, run_dir: str) -> None:
        missing = [m for m in ("encoder", "llm", "generator") if not (partial / m).is_dir()]
        rngs = len(list((partial / "rng").glob("rank*.pt")))
        if missing or rngs != self.world:
            raise OSError(f"incomplete: modules missing {missing}, {rngs}/{self.world} rank files")
        files = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT,
            "step": step,
            "time": time.time(),
            "recipe": self.recipe.source_file,
            "run_dir": str(Path(run_dir).resolve()),
            "fingerprint": fingerprint(self.recipe, self.world),
            "files": files,
        }
        tmp = partial / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / MANIFEST)
        os.rename(partial, final)
        _fsync_dir(final.parent)

    def _prune(self) -> None:
        keep = self.recipe.checkpoint.keep
        done = complete_checkpoints(self.root)
        for _, d in done[: max(0, len(done) - keep)] if keep else []:
            doomed = d.with_name(d.name + ".deleting")  # no longer looks complete, even half-deleted
            os.rename(d, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def load(self, path: Path, source) -> None:
        frozen = self.engine.optimizer is None
        load_path, _ = self.engine.load_checkpoint(
            str(path), tag=self.module, load_optimizer_states=not frozen, load_lr_scheduler_states=not frozen
        )
        if load_path is None:
            raise ConfigError(f"train.resume: {path} holds no '{self.module}' engine files")
        set_rng_state(torch.load(path / "rng" / f"rank{self.rank:05d}.pt", weights_only=False))
        try:
            source.load_state_dict(torch.load(path / "data.pt", weights_only=False)["source"])
        except ValueError as exc:
            raise ConfigError(f"train.resume: {path}: {exc}") from None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

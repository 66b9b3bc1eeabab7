"""Checkpoints of a pipeline layout: every module engine, the data order and RNG states, at one step.

Layout of ``checkpoint.dir``::

    step_00000300/
        encoder/ llm/ generator/    one DeepSpeed checkpoint per module engine (tag = module name)
        rng/rank00000.pt ...        each rank's RNG states (tensors and numbers only)
        data.json                   the sample source's state (cursor, skip counts)
        manifest.json               written last: step, layout, run directory, size and SHA-256 of every file,
                                    and which rank (stage, DP, TP index) wrote which engine file

A step is written into ``step_XXXXXXXX.partial`` and renamed once every rank has finished and the
manifest is on disk, so a directory named ``step_XXXXXXXX`` with a manifest is always complete; a
crash mid-save leaves only a ``.partial`` directory that resuming ignores. Complete checkpoints are
never written over: pruning renames a directory away before deleting it, and a leftover directory
of the same step that is not an intact checkpoint is renamed aside (``.invalid``, ``.damaged``).

Resuming checks every file against the manifest before anything is loaded (each rank an equal share
of its own module's files, its own RNG file and the data state), and reads files back only in forms
that cannot run code (``checkpoint/files.py``, ``checkpoint/engine.py``). A run with another layout (degrees,
world size, monolithic/disaggregated) re-shards the modules whose engines changed (``checkpoint/reshard_shards.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch.distributed as tdist

from disttrain_ds.checkpoint.files import (
    CHECKSUM,
    DATA_STATE,
    RNG_DIR,
    WRITE_ERRORS,
    file_entry,
    first_problem,
    load_data_state,
    load_rng,
    rng_file,
    save_data_state,
    save_rng,
    size_problem,
)
from disttrain_ds.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    Log,
    checkpoint_root,
    complete_checkpoints,
    fingerprint,
    inspect_step_dir,
    layout_changes,
    newest_intact,
    read_manifest,
    resolve_resume,
    set_aside,
    step_dir_name,
)
from disttrain_ds.checkpoint.reshard import describe_rank
from disttrain_ds.checkpoint.reshard_shards import load_resharded, must_reshard, resume_line
from disttrain_ds.data.host_read import merge_states
from disttrain_ds.errors import ConfigError, first_line
from disttrain_ds.estimate.memory import _size
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import Recipe


def share(files: dict[str, dict], names: list[str], parts: int, index: int) -> list[str]:
    """Part ``index`` of ``names`` split into ``parts`` of nearly equal total size (deterministic)."""
    loads, owner = [0] * parts, {}
    for name in sorted(names, key=lambda n: (-files[n]["size"], n)):
        k = loads.index(min(loads))
        owner[name], loads[k] = k, loads[k] + files[name]["size"]
    return sorted(n for n in names if owner[n] == index)


@dataclass
class Checkpointer:
    """Saves and loads this rank's share of a checkpoint; every rank calls the same methods."""

    recipe: Recipe
    engine: object
    """This rank's ``ModuleEngine`` (made by ``make_engine``: its checkpoint engine reads safely)."""
    module: str
    """This rank's module name (the DeepSpeed tag of its engine's files)."""
    rank: int
    world: int
    group: object
    """A gloo group over all ranks for bookkeeping collectives; None: one process acting alone."""
    log: Log = field(default=print)
    """Where rank 0 reports (fallbacks, verification time)."""
    _moved: list[str] = field(default_factory=list, init=False)
    """How this run's layout differs from the checkpoint being resumed (``layout_changes``)."""

    @property
    def root(self) -> Path:
        return checkpoint_root(self.recipe)

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` optimizer steps."""
        every = self.recipe.checkpoint.every
        return every > 0 and (step % every == 0 or step == self.recipe.train.steps)

    def _say(self, line: str) -> None:
        if self.rank == 0 or self.group is None:
            self.log(line)

    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        box = [None] * self.world
        tdist.all_gather_object(box, obj, group=self.group)
        return box

    def _on_rank0(self, work: Callable[[], object], failure: str):
        """Run file-system ``work`` on rank 0 and share its result; all ranks fail alike."""
        box = [None, None]
        if self.rank == 0 or self.group is None:
            try:
                box = [work(), None]
            except (OSError, ConfigError) as exc:
                box = [None, f"{failure}: {exc}"]
        if self.group is not None:
            tdist.broadcast_object_list(box, src=0, group=self.group)
        if box[1]:
            raise ConfigError(box[1])
        return box[0]

    # ---- saving --------------------------------------------------------------------------------
    def save(self, step: int, source, run_dir: str) -> Path:
        final = self.root / step_dir_name(step)
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0 or self.group is None:
            self.warn_if_short(step)
        self._on_rank0(lambda: self.prepare(final, partial), f"checkpoint.dir: cannot write {partial}")
        t0 = time.perf_counter()
        shares = self._gather(self.write_share(partial, step, source))
        failures = [failure for _, _, failure in shares if failure]
        if failures:  # every rank knows: rank 0 removes the half-written step, all stop with one line
            self._on_rank0(lambda: shutil.rmtree(partial, ignore_errors=True), "checkpoint.dir")
            raise ConfigError(self.write_failure(final, failures[0]))
        reported, shards = {}, {}
        for entries, record, _ in shares:
            reported.update(entries)
            shards.setdefault(record.pop("module"), []).append(record)
        self._on_rank0(lambda: (self.seal(partial, final, step, run_dir, reported, shards), self._prune(run_dir)),
                       f"checkpoint.dir: could not complete {final}")
        self.seconds = time.perf_counter() - t0
        return final

    def warn_if_short(self, step: int) -> None:
        """Rank 0, before a save: a warning naming the shortfall when the file system has less room
        than the newest complete checkpoint took."""
        done = complete_checkpoints(self.root)
        if not done:
            return
        size = sum(int(e.get("size", 0)) for e in (read_manifest(done[-1][1]) or {}).get("files", {}).values())
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return  # the save itself will say what is wrong with the directory
        if free < size:
            self._say(f"warning: checkpoint.dir {self.root} has {_size(free)} free, the last checkpoint took "
                      f"{_size(size)}: step {step}'s save may not fit (short by {_size(size - free)})")

    def write_failure(self, final: Path, failure: str) -> str:
        """The one line every rank stops with when a write of ``final`` failed."""
        try:
            free = f"{_size(shutil.disk_usage(self.root).free)} free there"
        except OSError:
            free = "free space unknown"
        done = [d for s, d in complete_checkpoints(self.root) if d != final]
        then = (f"the newest intact checkpoint is {done[-1]} (resume: auto continues from it once there is room)"
                if done else "there is no earlier checkpoint to resume from")
        return f"checkpoint.dir: could not write {final.name} in {self.root} ({failure}; {free}); {then}"

    def prepare(self, final: Path, partial: Path) -> None:
        """Rank 0, before a save: an empty ``partial`` directory, and no leftover ``final`` in the way."""
        if final.exists():
            self._clear_leftover(final)
        if partial.exists():  # left by a crash during an earlier save of this step
            shutil.rmtree(partial)
        (partial / RNG_DIR).mkdir(parents=True)

    def write_share(self, partial: Path, step: int, source) -> tuple[dict[str, dict], dict, str | None]:
        """This rank's files (its engine's, its RNG states, rank 0 the data state), their manifest
        entries, what its engine files hold (``reshard.describe_rank``, for another layout), and the
        first write that failed (None: all written). A failed write does not stop this rank here:
        it keeps step with the others through every collective of the save."""
        engine = getattr(self.engine, "checkpoint_engine", None)
        take_saved, take_failure = getattr(engine, "take_saved", None), getattr(engine, "take_failure", None)
        if take_saved:
            take_saved()
        # Each engine writes its own tag directory; DeepSpeed's internal barriers span all ranks,
        # which all call this together.
        self.engine.save_checkpoint(str(partial), tag=self.module, client_state={"step": step}, save_latest=False)
        written = take_saved() if take_saved else []
        failure = take_failure() if take_failure else None
        engine_files = [Path(os.path.relpath(os.path.abspath(p), os.path.abspath(partial))).as_posix() for p in written]
        grid = topology_of(self.recipe).module(self.module)
        record = describe_rank(self.engine.module, self.engine.optimizer, grid.data_coords(self.rank),
                               (grid.pp, grid.data_size, grid.tp), engine_files)
        record["module"] = self.module
        failure = failure or _attempt(lambda: save_rng(partial / rng_file(self.rank)))
        written.append(str(partial / rng_file(self.rank)))
        state = source.state_dict()
        if getattr(source, "host_units", None) is not None:  # each host advanced only the parts it reads
            state = merge_states(self._gather(state))
        if self.rank == 0:
            failure = failure or _attempt(lambda: save_data_state(state, partial / DATA_STATE))
            written.append(str(partial / DATA_STATE))
        if failure:
            return {}, record, f"rank {self.rank}: {failure}"
        # Checksummed by the rank that wrote them (still in its page cache), all ranks in parallel.
        base, entries = os.path.abspath(partial), {}
        for p in written:
            rel = os.path.relpath(os.path.abspath(p), base)
            if not rel.startswith(".."):
                entries[Path(rel).as_posix()] = file_entry(Path(p))
        return entries, record, None

    def _clear_leftover(self, final: Path) -> None:
        """A directory of the step being saved: refuse an intact checkpoint, set anything else aside."""
        manifest, why = inspect_step_dir(final)
        if manifest is not None:
            why = first_problem(final, manifest["files"], sorted(manifest["files"]), full=False)
            if why is None:
                raise ConfigError(f"checkpoint {final} already exists; it is never written over")
        aside = set_aside(final, "damaged" if manifest is not None else "invalid")
        self._say(f"checkpoint {final} is not an intact checkpoint ({why}); moved it to {aside.name}")

    def seal(self, partial: Path, final: Path, step: int, run_dir: str, reported: dict[str, dict],
             shards: dict[str, list[dict]] | None = None) -> None:
        """Rank 0, once every rank has written: check the parts, write the manifest, rename."""
        missing = [m for m in self.recipe.model.modules if not (partial / m).is_dir()]
        rngs = len(list((partial / RNG_DIR).glob("rank*.pt")))
        if missing or rngs != self.world:
            raise OSError(f"incomplete: modules missing {missing}, {rngs}/{self.world} rank files")
        on_disk = sorted(p.relative_to(partial).as_posix() for p in partial.rglob("*") if p.is_file())
        lost = sorted(set(reported) - set(on_disk))
        if lost:
            raise OSError(f"incomplete: {len(lost)} written files not found, e.g. {lost[0]}")
        files = {}
        for name in on_disk:  # files no rank reported (e.g. DeepSpeed's helper scripts): rank 0 checksums them
            files[name] = reported.get(name) or file_entry(partial / name)
            problem = size_problem(partial, name, files[name])
            if problem:
                raise OSError(f"incomplete: {problem} (not yet visible here?)")
        manifest = {
            "format": FORMAT,
            "step": step,
            "time": time.time(),
            "recipe": self.recipe.source_file,
            "run_dir": str(Path(run_dir).resolve()),
            "fingerprint": fingerprint(self.recipe, self.world),
            "checksum": CHECKSUM,
            "files": files,
            "shards": shards or {},  # which rank wrote which engine file: resuming under another layout
        }
        tmp = partial / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / MANIFEST)
        os.rename(partial, final)
        _fsync_dir(final.parent)

    def _prune(self, run_dir: str) -> None:
        """Keep the newest ``checkpoint.keep`` checkpoints of this run (its run directory's: a resume
        continues it); another run's checkpoints in the same directory are never removed."""
        keep = self.recipe.checkpoint.keep
        mine = str(Path(run_dir).resolve())
        done = [(s, d) for s, d in complete_checkpoints(self.root) if (read_manifest(d) or {}).get("run_dir") == mine]
        for _, d in done[: max(0, len(done) - keep)] if keep else []:
            doomed = d.with_name(d.name + ".deleting")  # no longer looks complete, even half-deleted
            os.rename(d, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # ---- resuming ------------------------------------------------------------------------------
    def load(self, path: Path, source) -> None:
        """Verify and load ``path``; a damaged checkpoint is an error (under ``train.resume: auto``
        it is also set aside, so the next run continues from the previous one)."""
        self.resume(path, source, fall_back=False)

    def resume(self, path: Path, source, fall_back: bool = True) -> tuple[Path, dict]:
        """Verify and load ``path``; under ``train.resume: auto`` a damaged checkpoint is set aside
        (``.damaged``) and the newest intact earlier one is loaded instead. Returns what was loaded."""
        manifest, why = inspect_step_dir(path)
        if manifest is None:
            raise ConfigError(f"train.resume: {path} is not a complete checkpoint ({why})")
        self._moved = layout_changes(manifest, self.recipe, self.world)
        auto = self.recipe.train.resume == "auto"
        while (problem := self._verify(path, manifest)) is not None:
            if not auto:
                raise ConfigError(f"train.resume: {path} is damaged: {problem}")
            aside = self._on_rank0(lambda p=path: set_aside(p, "damaged"), f"train.resume: cannot set aside {path}")
            found = newest_intact(self.recipe, self.world, manifest["step"], self._say) if fall_back else None
            if found is None:
                then = "relaunch to continue from the previous checkpoint" if not fall_back else "no intact earlier checkpoint is left"
                raise ConfigError(f"train.resume: {path} is damaged: {problem}; moved it to {aside.name}; {then}")
            self._say(f"train.resume: auto: {path} is damaged ({problem}); moved it to {aside.name}; "
                      f"resuming from {found[0]} (step {found[1]['step']}) instead")
            path, manifest = found
            self._moved = layout_changes(manifest, self.recipe, self.world)
        self._load_verified(path, manifest, source)
        return path, manifest

    def my_files(self, files: dict[str, dict]) -> list[str]:
        """What this rank checks: an equal share (by size) of its module's files among the module's
        ranks, its own RNG file, the data state, and (rank 0) anything else outside module folders."""
        ranks = list(topology_of(self.recipe).module(self.module).ranks)
        ours = [n for n in files if n.startswith(self.module + "/")]
        mine = share(files, ours, len(ranks), ranks.index(self.rank))
        mine += [n for n in (rng_file(self.rank), DATA_STATE) if n in files]
        if self.rank == 0:
            mine += [n for n in files if n.split("/")[0] not in (*self.recipe.model.modules, RNG_DIR) and n != DATA_STATE]
        return mine

    def _verify(self, path: Path, manifest: dict) -> str | None:
        """Every rank checks its files (``my_files``) in parallel; the first problem found anywhere, or None."""
        t0, files = time.perf_counter(), manifest["files"]
        mine = self.my_files(files)
        needed = (DATA_STATE,) if self._moved else (rng_file(self.rank), DATA_STATE)  # RNG files are per rank
        problem = next((f"{n} is not in the manifest" for n in needed if n not in files), None)
        problem = problem or first_problem(path, files, mine)
        if problem is None and self.rank == topology_of(self.recipe).module(self.module).ranks[0]:
            problem = self._unlisted(path, files)
        results = self._gather((problem, sum(files[n]["size"] for n in mine), time.perf_counter() - t0))
        total, slowest = sum(r[1] for r in results), max(r[2] for r in results)
        self._say(f"checkpoint {path}: {total / 2**30:.3f} GiB checked ({CHECKSUM}) in {slowest:.2f} s by {len(results)} ranks")
        return next((r[0] for r in results if r[0]), None)

    def _unlisted(self, path: Path, files: dict[str, dict]) -> str | None:
        """DeepSpeed globs its tag folder for files to load: nothing the manifest does not list may be there."""
        tag = path / self.module
        if not tag.is_dir():
            return f"{self.module}/ is missing"
        for p in sorted(tag.rglob("*")):
            name = p.relative_to(path).as_posix()
            if p.is_file() and name not in files:
                return f"{name} is not listed in the manifest"
        return None

    def _load_verified(self, path: Path, manifest: dict, source) -> None:
        done = load_resharded(self, path, manifest) if must_reshard(self, manifest) else self._load_engine(path, manifest)
        loaded = self._gather((self.module, done))  # every rank: some modules may be re-sharded, others not
        if self._moved or any(d for _, d in loaded):
            self._say(resume_line(path, manifest["step"], self._moved, loaded))
        if not self._moved:
            load_rng(path / rng_file(self.rank))
        self._load_data(path, source)

    def _load_engine(self, path: Path, manifest: dict) -> list[str]:
        """DeepSpeed reads this module's files as they are (same engine layout); nothing re-sharded."""
        checkpoint_engine = getattr(self.engine, "checkpoint_engine", None)
        if not hasattr(checkpoint_engine, "expected"):
            raise RuntimeError("the engine was not made by make_engine: its checkpoint engine would unpickle files")
        checkpoint_engine.expected = {os.path.abspath(path / n): e["size"] for n, e in manifest["files"].items()}
        frozen = self.engine.optimizer is None
        try:
            load_path, _ = self.engine.load_checkpoint(
                str(path), tag=self.module, load_optimizer_states=not frozen, load_lr_scheduler_states=not frozen
            )
        finally:
            checkpoint_engine.expected = None
        if load_path is None:
            raise ConfigError(f"train.resume: {path} holds no '{self.module}' engine files")
        return []

    def _load_data(self, path: Path, source) -> None:
        try:
            source.load_state_dict(load_data_state(path / DATA_STATE))
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"train.resume: {path}: {exc}") from None


def _attempt(write: Callable[[], object]) -> str | None:
    """Run one file write; what failed (no space, quota, read-only file system), or None."""
    try:
        write()
    except WRITE_ERRORS as exc:
        return first_line(exc)
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

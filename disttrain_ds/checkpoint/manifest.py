"""Step directories and their manifests: which checkpoints are complete and intact, which one to resume.

Pure file-system bookkeeping, run by every rank before any process group starts; the checksums of
the chosen checkpoint are checked afterwards, in parallel (``checkpointing.Checkpointer.resume``).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Callable

from disttrain_ds.checkpoint.files import CHECKSUM, first_problem, valid_entry
from disttrain_ds.configtools import to_dict
from disttrain_ds.data.config import DataConfig
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.graph import as_written
from disttrain_ds.recipe.schema import Recipe

MANIFEST = "manifest.json"
FORMAT = 2
"""2: RNG states as plain tensors, data state as JSON, checksums of every file (1 held pickles)."""
_STEP_DIR = re.compile(r"^step_(\d{8})$")

Log = Callable[[str], None]


def checkpoint_root(recipe: Recipe) -> Path:
    return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else Path("checkpoints") / recipe.name


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def inspect_step_dir(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) for a complete checkpoint directory, else (None, why it is not one)."""
    m = _STEP_DIR.match(path.name)
    if not m:
        return None, "not a step_XXXXXXXX directory"
    try:
        data = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"no {MANIFEST}"
    except OSError as exc:
        return None, f"{MANIFEST} cannot be read ({exc.strerror or exc})"
    except (ValueError, RecursionError):
        return None, f"{MANIFEST} is not valid JSON (truncated?)"
    if not isinstance(data, dict):
        return None, f"{MANIFEST} is not a JSON object"
    if data.get("format") != FORMAT:
        return None, f"{MANIFEST} has format {data.get('format')!r}; this version reads format {FORMAT}"
    if data.get("step") != int(m.group(1)):
        return None, f"{MANIFEST} is for step {data.get('step')!r}"
    files = data.get("files")
    if not isinstance(files, dict) or not all(valid_entry(k, v) for k, v in files.items()):
        return None, f"{MANIFEST} does not list its files with size and {CHECKSUM}"
    if not isinstance(data.get("fingerprint"), dict) or not isinstance(data.get("run_dir"), str):
        return None, f"{MANIFEST} lacks the run's fingerprint or run directory"
    return data, None


def read_manifest(path: Path) -> dict | None:
    """The manifest of a complete checkpoint directory, or None if it is not one."""
    return inspect_step_dir(path)[0]


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), d) for d in root.iterdir() if (m := _STEP_DIR.match(d.name)) and d.is_dir())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root``, oldest first."""
    return [(s, d) for s, d in _step_dirs(root) if read_manifest(d) is not None]


def fingerprint(recipe: Recipe, world: int) -> dict:
    """What a checkpoint must agree with to be resumed: model, data, batch and rank layout."""
    r = as_written(recipe)
    return {
        "world_size": world,
        "layout": recipe.layout,
        "seed": recipe.seed,
        "model": r["model"],
        "data": r["data"],
        "parallel": {m: to_dict(p) for m, p in recipe.parallel.modules.items()},
        "train.global_batch": recipe.train.global_batch,
        "train.micro_batch": recipe.train.micro_batch,
        "train.dtype": recipe.train.dtype,
        "optim.name": recipe.optim.name,
    }


MODULE_KEYS_IGNORED = ("doc_attention",)
"""Module fields that never change what a run computes (the LLM's attention path: the same
function either way): left out of every fingerprint comparison."""
DATA_KEYS_IGNORED = ("read",)
"""``data`` fields that do not change the samples (which host reads what; the data state's own
fingerprint leaves them out too): left out of every fingerprint comparison."""
DATA_KEYS_LATER = ("max_audio", "audio_frames", "fields.audio", "fields.audios", "max_seq_len")
"""``data`` fields added after checkpoints were first written: at their defaults they read the data
as before, so a checkpoint without them compares as if it held the defaults."""


_MISSING = object()


def _data_defaults() -> dict:
    return to_dict(DataConfig())


def _get_path(d, path: str):
    for p in path.split("."):
        if not isinstance(d, dict) or p not in d:
            return _MISSING
        d = d[p]
    return d


def _pop_path(d: dict, path: str) -> None:
    *parents, leaf = path.split(".")
    parent = _get_path(d, ".".join(parents)) if parents else d
    if isinstance(parent, dict):
        parent.pop(leaf, None)


def comparable(fp: dict) -> dict:
    """A fingerprint as compared on resume: without fields that do not change the run's math
    (``MODULE_KEYS_IGNORED``, a VAE's encode ``batch``, ``DATA_KEYS_IGNORED``), without a disabled
    VAE (no ``preset`` or ``checkpoint``: what a generator before VAEs existed ran), and without
    later ``data`` fields at their defaults; both sides go through it, so checkpoints written
    before those fields resume."""
    fp = copy.deepcopy(fp)
    model = fp.get("model") if isinstance(fp.get("model"), dict) else {}
    nested = model.get("modules") if isinstance(model.get("modules"), dict) else {}
    for m in [*(v for k, v in model.items() if k != "modules"), *nested.values()]:
        if not isinstance(m, dict):
            continue
        for key in MODULE_KEYS_IGNORED:
            m.pop(key, None)
        vae = m.get("vae")
        if isinstance(vae, dict):
            vae.pop("batch", None)
            if not vae.get("preset") and not vae.get("checkpoint"):
                m.pop("vae")
    data = fp.get("data")
    if isinstance(data, dict):
        for key in DATA_KEYS_IGNORED:
            data.pop(key, None)
        defaults = _data_defaults()
        for path in DATA_KEYS_LATER:
            if _get_path(data, path) == _get_path(defaults, path):
                _pop_path(data, path)
    return fp


LAYOUT_KEYS = ("world_size", "layout", "parallel", "train.micro_batch")
"""Fingerprint entries a run may change on resume: the module engines are re-sharded
(``reshard.py``). Every other entry (model, data, seed, global batch, dtype, optimizer) must match."""


def differences(a, b, prefix: str = "") -> list[str]:
    """Every leaf where two fingerprints differ, as ``key (checkpoint: x, this run: y)``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [f"{prefix} (checkpoint: {a!r}, this run: {b!r})"]


PARALLEL_KEYS_LATER = {"sp": 1}
"""``parallel.<module>`` fields added after checkpoints were first written, with their defaults:
at those they lay the module out as before, so a checkpoint without them compares as if it held them."""


def _layout(fp: dict) -> dict:
    out = copy.deepcopy({k: fp.get(k) for k in LAYOUT_KEYS})
    par = out.get("parallel") if isinstance(out.get("parallel"), dict) else {}
    nested = par.get("modules") if isinstance(par.get("modules"), dict) else {}
    for m in [*par.values(), *nested.values()]:
        if isinstance(m, dict) and "dp" in m:  # one module's degrees
            for key, default in PARALLEL_KEYS_LATER.items():
                m.setdefault(key, default)
    return out


def layout_changes(manifest: dict, recipe: Recipe, world: int) -> list[str]:
    """How this run's layout differs from the checkpoint's (empty: the same layout)."""
    return differences(_layout(manifest["fingerprint"]), _layout(fingerprint(recipe, world)))


def _rank0_print(line: str) -> None:
    """Before process groups exist every rank resolves the same checkpoint: rank 0 says so."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def _check_usable(recipe: Recipe, world: int, path: Path, manifest: dict) -> None:
    src = recipe.source_file
    old, new = comparable(manifest["fingerprint"]), comparable(fingerprint(recipe, world))
    fixed = differences({k: v for k, v in old.items() if k not in LAYOUT_KEYS},
                        {k: v for k, v in new.items() if k not in LAYOUT_KEYS})
    if fixed:
        raise ConfigError(f"{src}: 'train.resume' {path} was written by a different setup; only the layout may "
                          f"change on resume: {'; '.join(fixed)}")
    moved = layout_changes(manifest, recipe, world)
    if moved and not isinstance(manifest.get("shards"), dict):
        raise ConfigError(f"{src}: 'train.resume' {path} was written by a different layout and does not describe "
                          f"its shards (written by an earlier version), so it cannot be re-sharded: {'; '.join(moved)}")
    if manifest["step"] > recipe.train.steps:
        raise ConfigError(
            f"{src}: 'train.steps' {recipe.train.steps} is below the checkpoint's step {manifest['step']} ({path})"
        )


def newest_intact(recipe: Recipe, world: int, below: int | None, log: Log) -> tuple[Path, dict] | None:
    """The newest complete checkpoint (before step ``below``) whose files all have their recorded
    sizes; each one passed over is logged in one line."""
    root = checkpoint_root(recipe)
    for step, path in reversed(_step_dirs(root)):
        if below is not None and step >= below:
            continue
        manifest, why = inspect_step_dir(path)
        if manifest is None:
            log(f"train.resume: auto: skipping {path}: not a complete checkpoint ({why})")
            continue
        problem = first_problem(path, manifest["files"], sorted(manifest["files"]), full=False)
        if problem:
            log(f"train.resume: auto: skipping {path}: damaged, {problem}")
            continue
        _check_usable(recipe, world, path, manifest)
        return path, manifest
    return None


def resolve_resume(recipe: Recipe, world: int, log: Log | None = None) -> tuple[Path | None, dict | None]:
    """The checkpoint this run starts from (``train.resume``), checked against the recipe.

    ``auto`` takes the newest intact checkpoint (directories without a valid manifest, or with a
    file missing or of the wrong size, are passed over and logged); an explicit path must be intact.
    Checksums are checked later, by every rank in parallel (``Checkpointer.resume``).
    """
    log = log or _rank0_print
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
        found = newest_intact(recipe, world, None, log)
        if found is None:
            if complete_checkpoints(root):
                raise ConfigError(
                    f"{src}: 'train.resume' auto: no checkpoint in {root} is intact (see above); move them aside "
                    "or choose another checkpoint.dir"
                )
            return None, None
        return found
    path = Path(mode)
    manifest, why = inspect_step_dir(path)
    if manifest is None:
        raise ConfigError(f"{src}: 'train.resume' {path} is not a complete checkpoint ({why})")
    problem = first_problem(path, manifest["files"], sorted(manifest["files"]), full=False)
    if problem:
        raise ConfigError(f"{src}: 'train.resume' {path} is damaged: {problem}")
    _check_usable(recipe, world, path, manifest)
    later = [s for s, _ in complete_checkpoints(root) if s > manifest["step"]]
    if later and recipe.checkpoint.every:
        raise ConfigError(
            f"{src}: 'train.resume' {path} is step {manifest['step']} but {root} holds later "
            f"checkpoints (step {later[-1]}) that this run would write over; move them or choose another checkpoint.dir"
        )
    return path, manifest


def set_aside(path: Path, label: str) -> Path:
    """Rename ``path`` to ``<path>.<label>`` (or ``.<label>.N``, the first free name); nothing is deleted."""
    target, n = path.with_name(f"{path.name}.{label}"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{label}.{n}")
    os.rename(path, target)
    return target

"""What a checkpoint's own files hold, and reading any checkpoint file back without running code.

- RNG states (``rng/rankXXXXX.pt``) are tensors, numbers and strings in a torch file, read with
  ``weights_only=True`` and no extra allowed types;
- the data state (``data.json``) is JSON;
- every file's size and SHA-256 are recorded in the manifest and checked before it is used.

A file that would need anything beyond plain tensors and containers to load is refused with one
line naming it (``CheckpointFileError``); its contents are never executed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from disttrain_ds.errors import ConfigError

CHECKSUM = "sha256"
"""Digest of every file in the manifest (with SHA extensions it outruns BLAKE2b: docs/reliability.md)."""
RNG_DIR = "rng"
DATA_STATE = "data.json"
WRITE_ERRORS = (OSError, RuntimeError)
"""What a failed checkpoint write raises: no space, quota or a read-only file system (torch's zip
writer reports a full disk as RuntimeError)."""


class CheckpointFileError(ConfigError):
    """A checkpoint file that is missing, damaged, not listed or not a plain checkpoint; one line naming it."""


def rng_file(rank: int) -> str:
    """A rank's RNG file, relative to the step directory."""
    return f"{RNG_DIR}/rank{rank:05d}.pt"


# ---- checksums ---------------------------------------------------------------------------------
def file_entry(path: Path) -> dict:
    """The manifest entry of a file: ``{"size": bytes, "sha256": hex digest}``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.file_digest(f, CHECKSUM).hexdigest()
    return {"size": size, CHECKSUM: digest}


def valid_entry(name: object, entry: object) -> bool:
    """Whether a manifest names a file inside the step directory with a size and digest."""
    if not isinstance(name, str) or not isinstance(entry, dict):
        return False
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts or name != Path(name).as_posix():
        return False
    size, digest = entry.get("size"), entry.get(CHECKSUM)
    return (type(size) is int and size >= 0 and isinstance(digest, str)
            and re.fullmatch(r"[0-9a-f]{64}", digest) is not None)


def size_problem(root: Path, name: str, entry: dict) -> str | None:
    """Quick check (one ``stat``): None, or why ``root/name`` cannot be the file the manifest lists."""
    try:
        size = (root / name).stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror or exc})"
    if size != entry["size"]:
        return f"{name} is {size} bytes, the manifest says {entry['size']}"
    return None


def file_problem(root: Path, name: str, entry: dict) -> str | None:
    """Full check: None, or why ``root/name`` differs from its manifest entry (size, then checksum)."""
    problem = size_problem(root, name, entry)
    if problem:
        return problem
    try:
        actual = file_entry(root / name)
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror or exc})"
    if actual != entry:
        return f"{name} does not match its {CHECKSUM} checksum"
    return None


def first_problem(root: Path, files: dict[str, dict], names: Iterable[str], full: bool = True) -> str | None:
    """The first of ``names`` that fails its check (full: size and checksum; else size only)."""
    check = file_problem if full else size_problem
    for name in names:
        problem = check(root, name, files[name])
        if problem:
            return problem
    return None


# ---- reading torch files without running code ---------------------------------------------------
def _refusal(exc: BaseException) -> str:
    found = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", str(exc))
    if found:
        return f"loading it would call {found.group(1)}"
    lines = [ln.strip() for ln in str(exc).splitlines() if "WeightsUnpickler error" in ln]
    return lines[0].split(":", 1)[-1].strip() if lines else "it holds objects other than tensors and containers"


def safe_load(path: str | os.PathLike, map_location: Any = None, allowed: Iterable[type] = ()) -> Any:
    """``torch.load(weights_only=True)`` with only ``allowed`` added to torch's plain types.

    A file that needs anything else, or cannot be parsed, is a ``CheckpointFileError`` naming it.
    """
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointFileError(f"checkpoint file {path} is not a plain checkpoint ({_refusal(exc)}); refused to load it") from None
    except FileNotFoundError:
        raise CheckpointFileError(f"checkpoint file {path} is missing") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointFileError(f"checkpoint file {path} cannot be read: {first}") from None


# ---- RNG states ---------------------------------------------------------------------------------
def rng_state() -> dict:
    """This process's Python, NumPy, torch (and CUDA) RNG states as tensors and plain numbers."""
    version, internal, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"key": str(key), "state": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_rng(path: Path) -> None:
    torch.save(rng_state(), path)


def load_rng(path: Path) -> None:
    """Restore the RNG states in ``path`` (refused in one line if it holds anything but plain data)."""
    state = safe_load(path, map_location="cpu")
    try:
        py, npy = state["python"], state["numpy"]
        py_state = (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"])
        np_state = (str(npy["key"]), npy["state"].numpy().astype(np.uint32), int(npy["pos"]), int(npy["has_gauss"]),
                    float(npy["cached_gaussian"]))
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointFileError(f"checkpoint file {path} does not hold RNG states ({type(exc).__name__}: {exc})") from None


# ---- data state ---------------------------------------------------------------------------------
def save_data_state(state: dict, path: Path) -> None:
    """The sample source's state as JSON (plain numbers, strings, lists and dicts only)."""
    try:
        text = json.dumps({"source": state}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointFileError(f"the data state cannot be written as JSON to {path}: {exc}") from None
    path.write_text(text)


def load_data_state(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointFileError(f"checkpoint file {path} is missing") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointFileError(f"checkpoint file {path} is not a plain checkpoint (not JSON: {type(exc).__name__}); refused to load it") from None
    if not isinstance(data, dict) or not isinstance(data.get("source"), dict):
        raise CheckpointFileError(f"checkpoint file {path} does not hold a data state")
    return data["source"]

"""The spool's files: privacy checks, the batch file format, atomic writes (``spool.py`` uses them).

A batch file holds tensors and plain values only (``PackedSample.to_plain``) and is read with
``weights_only=True``: a file holding anything else is refused, never run. The directory is
mode 0700 and its files 0600; it is used only while it is a real directory owned by this user
that no other user can write to (``check_private``).
"""

from __future__ import annotations

import os
import pickle
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from disttrain_ds.samples import PackedSample

KEY = "data.spool_dir"  # the recipe key errors about the spool's file system name
FORMAT = "disttrain-spool-batch/2"
"""Tag of the batch file layout (``encode_batch``)."""


class SpoolError(RuntimeError):
    """The shared batch spool cannot be used or a producer failed; ``details`` holds a traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


# ----------------------------------------------------------------------------- privacy


def check_private(directory: Path) -> None:
    """Refuse a spool that is a link, not a directory, someone else's, or open to other users.

    Raises ``FileNotFoundError`` when it does not exist (yet), ``SpoolError`` otherwise.
    """
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SpoolError(f"{KEY}: cannot use spool {directory}: {exc.strerror or exc}") from None
    mode, me = stat.S_IMODE(st.st_mode), os.getuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != me:
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {me})"
    elif mode & 0o022:
        problem = f"is writable by other users (mode {mode:04o})"
    elif mode & 0o077:
        problem = f"is open to other users (mode {mode:04o})"
    else:
        return
    raise SpoolError(f"{KEY}: spool {directory} {problem}; remove it or set {KEY} to another directory")


def _check_base(base: Path) -> None:
    """A base directory anyone may write to needs the sticky bit (as /dev/shm and /tmp have)."""
    mode = os.stat(base).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise SpoolError(f"{KEY}: {base} is writable by other users without the sticky bit "
                         f"(mode {stat.S_IMODE(mode):04o}); set {KEY} to a private directory")


def _ours(path: Path) -> bool:
    """A real directory (not a link) owned by this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


# ----------------------------------------------------------------------------- batch files


@dataclass
class SpoolBatch:
    """One step as the producers write it and every rank reads it."""

    step: int
    samples: list[PackedSample | None]
    """The global batch; None where this host reads nothing (``data.read: host``)."""
    plan: dict[str, int]
    """Skip counts of the packing plan up to this step."""
    extra: dict[str, int]
    """Skips found while preparing this step (decode failures)."""
    state: dict
    """The producer's source state after this step (plain values)."""


_SCALARS = (type(None), bool, int, float, str)


def plain_problem(value: object, where: str) -> str | None:
    """Where ``value`` holds something other than tensors, scalars, lists, tuples and dicts, or None."""
    kind = type(value)
    if kind in _SCALARS or kind is torch.Tensor:
        return None
    if kind in (list, tuple):
        items = enumerate(value)
    elif kind is dict:
        items = value.items()
        bad = next((k for k in value if type(k) not in (str, int)), None)
        if bad is not None:
            return f"{where} has a {type(bad).__name__} key"
    else:
        return f"{where} is a {kind.__module__}.{kind.__qualname__}"
    for key, item in items:
        problem = plain_problem(item, f"{where}[{key!r}]")
        if problem:
            return problem
    return None


def encode_batch(batch: SpoolBatch) -> dict:
    """The file's content: tensors and plain values (``SpoolError`` naming anything else)."""
    out = {"format": FORMAT, "step": batch.step, "samples": [s.to_plain() if s is not None else None for s in batch.samples],
           "plan": batch.plan, "extra": batch.extra, "state": batch.state}
    problem = plain_problem(out, "batch")
    if problem:
        raise SpoolError(f"step {batch.step} cannot be written to the spool: {problem} "
                         "(a batch file holds only tensors, numbers, strings, lists, tuples and dicts)")
    return out


def load_batch(path: Path) -> SpoolBatch:
    """Map a batch file (tensors stay backed by the file); refuse one that is not plain tensors and values."""
    try:
        raw = torch.load(path, mmap=True, weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError:  # what weights_only refuses: any other class, any callable
        raise SpoolError(f"{KEY}: refused {path}: it holds objects other than tensors and plain values") from None
    except Exception as exc:  # noqa: BLE001 - not a torch.save zip, truncated, ...
        raise SpoolError(f"{KEY}: refused {path}: it is not a batch file ({type(exc).__name__})") from None
    try:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        step, plan, extra, state = raw["step"], raw["plan"], raw["extra"], raw["state"]
        counts = [v for c in (plan, extra) if isinstance(c, dict) for v in (*c, *c.values())]
        if not (isinstance(step, int) and isinstance(plan, dict) and isinstance(extra, dict)
                and all(isinstance(v, (str, int)) for v in counts) and isinstance(state, dict)):
            raise ValueError("its step, skip counts or source state are of the wrong type")
        if not isinstance(raw["samples"], list):
            raise ValueError("its samples are not a list")
        samples = [PackedSample.from_plain(s) if s is not None else None for s in raw["samples"]]
    except (KeyError, ValueError) as exc:
        raise SpoolError(f"{KEY}: refused {path}: {exc}") from None
    return SpoolBatch(step, samples, plan, extra, state)


def _step_file(directory: Path, step: int) -> Path:
    return directory / f"step_{step:09d}.pt"


def _write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write a new file of mode 0600 (whatever the umask) and move it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # left by an earlier process with this pid
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o600)
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written batch must not hold shared memory
        raise


def _write_text(path: Path, text: str) -> None:
    _write_atomic(path, lambda f: f.write(text.encode()))

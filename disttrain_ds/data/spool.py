"""Prepared global batches shared by every trainer rank of one host (``data.share: node``).

The lowest global rank on each host (the node's data leader) runs the ``data.producers``
processes. They write each prepared global batch once, as one file in a spool directory in
shared memory (``/dev/shm`` unless ``data.spool_dir`` says otherwise), and every trainer rank on
the host maps it (``torch.load(mmap=True)``: a rank touches the pages of the samples it uses).
Each reader records the last step it consumed; producers stay at most ``data.queue_depth``
batches ahead of the slowest reader and the leader deletes batches every reader has consumed.

Files in a spool directory (``disttrain-spool-<token>``, unique per launch):
``owner`` (host and pid of the leader), ``step_<step>.pt``, ``read_<rank>`` (last step that rank
consumed), ``error_<producer>.json`` (a producer's failure, read by every rank on the host).

A batch file holds tensors and plain values only (``PackedSample.to_plain``) and is read with
``weights_only=True``: a file holding anything else is refused, never run. The directory is
mode 0700 and its files 0600; it is used only while it is a real directory owned by this user
that no other user can write to (``check_private``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from .types import PackedSample

PREFIX = "disttrain-spool-"
KEY = "data.spool_dir"  # the recipe key errors about the spool's file system name
_POLL_S = 0.005
_POLL_MAX_S = 0.05
FORMAT = "disttrain-spool-batch/1"
"""Tag of the batch file layout (``encode_batch``)."""


class SpoolError(RuntimeError):
    """The shared batch spool cannot be used or a producer failed; ``details`` holds a traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def default_base() -> Path:
    """Node-local shared memory where there is some, else the system temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def host_key() -> str:
    """Ranks with equal keys share a spool: same host name and same kernel boot."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class NodeShare:
    """One rank's place in its host's spool."""

    directory: Path
    """The spool directory of this launch on this host."""
    rank: int
    """This rank (global)."""
    readers: tuple[int, ...]
    """Global ranks on this host, ascending; the first is the data leader."""
    leader_pid: int
    """Process id of the leader rank (readers check it is alive while they wait)."""

    @property
    def leader(self) -> bool:
        return self.rank == self.readers[0]


def plan_shares(hosts: list[tuple[str, int]], token: str, base: Path) -> list[NodeShare]:
    """Every rank's ``NodeShare`` from all ranks' ``(host key, pid)``, in rank order."""
    groups: dict[str, list[int]] = {}
    for rank, (key, _) in enumerate(hosts):
        groups.setdefault(key, []).append(rank)
    out = []
    for rank, (key, _) in enumerate(hosts):
        readers = tuple(groups[key])
        out.append(NodeShare(base / f"{PREFIX}{token}", rank, readers, hosts[readers[0]][1]))
    return out


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def consumed(directory: Path, readers: tuple[int, ...], before: int) -> int:
    """Last step every reader has consumed (``before`` if some reader has consumed none)."""
    low = None
    for r in readers:
        try:
            step = int((directory / f"read_{r}").read_text())
        except (OSError, ValueError):
            return before
        low = step if low is None else min(low, step)
    return before if low is None else max(low, before)


# ----------------------------------------------------------------------------- leader


def create(share: NodeShare) -> None:
    """Leader: make this launch's spool directory (removing spools of dead launches on this host)."""
    base, directory = share.directory.parent, share.directory
    try:
        base.mkdir(parents=True, exist_ok=True)
        _check_base(base)
        remove_stale(base)
        directory.mkdir(mode=0o700)  # fails if the name exists: a directory planted under it is never used
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask; never wider than 0700 meanwhile
        check_private(directory)
        _write_text(directory / "owner", f"{host_key()} {os.getpid()}\n")
    except OSError as exc:
        raise SpoolError(f"{KEY}: cannot create a batch spool in {base}: {exc.strerror or exc}") from None


def remove_stale(base: Path) -> list[Path]:
    """Remove spools in ``base`` owned by this user whose leader ran on this host and is gone; nothing else."""
    removed, me = [], host_key()
    for d in base.glob(f"{PREFIX}*"):
        if not _ours(d):
            continue  # another user's, or a link: never touched
        try:
            key, pid = (d / "owner").read_text().split()
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if key == me and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def reset(directory: Path) -> None:
    """Leader, before (re)starting producers: drop batches, read marks and errors of an earlier start."""
    check_private(directory)
    for f in directory.iterdir():
        if f.name.startswith(("step_", "read_", "error_", ".step_")):
            f.unlink(missing_ok=True)


def collect(directory: Path, readers: tuple[int, ...]) -> None:
    """Leader: delete the batches every reader has consumed."""
    done = consumed(directory, readers, -1)
    for f in directory.glob("step_*.pt"):
        if int(f.stem[5:]) <= done:
            f.unlink(missing_ok=True)


def remove(directory: Path) -> None:
    """Remove this launch's spool (only a real directory owned by this user)."""
    if _ours(directory):
        shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------------- producers


@dataclass(frozen=True)
class SpoolWriter:
    """A producer's end: waits for room, then writes one batch file atomically."""

    directory: Path
    readers: tuple[int, ...]
    depth: int
    """Batches allowed ahead of the slowest reader."""
    first_step: int
    """First step of this start: every reader has consumed ``first_step - 1``."""

    def put(self, batch: SpoolBatch, keep_going: Callable[[], bool]) -> bool:
        """Write ``batch`` once there is room; False if told to stop while waiting."""
        step, payload = batch.step, encode_batch(batch)
        check_private(self.directory)  # before reading the read marks in it
        while True:
            if not keep_going():  # also stops an orphan whose trainer was killed
                return False
            if consumed(self.directory, self.readers, self.first_step - 1) + self.depth >= step:
                break
            time.sleep(_POLL_MAX_S)
        path = _step_file(self.directory, step)
        try:
            check_private(self.directory)
            _write_atomic(path, lambda f: torch.save(payload, f))
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise SpoolError(f"{KEY}: cannot write step {step} to {self.directory}: {why} "
                             "(point it to a larger file system, or give the container more /dev/shm)") from None
        return True

    def error(self, producer: int, step: int, line: str, details: str) -> None:
        body = json.dumps({"producer": producer, "step": step, "line": line, "details": details})
        try:
            check_private(self.directory)
            _write_text(self.directory / f"error_{producer}.json", body)
        except (OSError, SpoolError):
            pass  # the leader still sees the producer exit without a batch (and checks the spool itself)


# ----------------------------------------------------------------------------- readers


def fetch(share: NodeShare, step: int, problem: Callable[[], str | None]) -> SpoolBatch:
    """Wait for ``step``'s batch, map it and mark it consumed.

    ``problem`` says why waiting is futile (e.g. a producer exited), or None.
    """
    path, pause = _step_file(share.directory, step), _POLL_S
    while True:
        try:
            check_private(share.directory)  # missing until the leader has made it
            batch = load_batch(path)
            break
        except FileNotFoundError:
            pass  # not written yet
        gone = problem()  # asked before reading errors: a producer writes its error, then exits
        for err in sorted(share.directory.glob("error_*.json")):
            try:
                e = json.loads(err.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(e, dict):
                raise SpoolError(f"producer {e.get('producer')} failed at step {e.get('step')}: {e.get('line')}",
                                 str(e.get("details", "")))
        if gone:
            raise SpoolError(gone)
        if not share.leader and not _pid_alive(share.leader_pid):
            raise SpoolError(f"the data leader of this host (rank {share.readers[0]}) is gone; "
                             f"no batch for step {step}")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    if batch.step != step:
        raise SpoolError(f"{path} holds step {batch.step}, not {step}")
    _write_text(share.directory / f"read_{share.rank}", str(step))
    return batch

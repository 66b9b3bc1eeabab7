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

The files themselves (batch file format, privacy checks, atomic writes) are ``spool_files.py``;
this module is the protocol between the leader, its producers and the host's readers.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from disttrain_ds.data.spool_files import (
    FORMAT,
    KEY,
    SpoolBatch,
    SpoolError,
    _check_base,
    _ours,
    _step_file,
    _write_atomic,
    _write_text,
    check_private,
    encode_batch,
    load_batch,
    plain_problem,
)

PREFIX = "disttrain-spool-"
_POLL_S = 0.005
_POLL_MAX_S = 0.05


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

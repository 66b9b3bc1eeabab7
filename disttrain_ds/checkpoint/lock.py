"""One job per directory: a lock file in ``checkpoint.dir`` and in the run directory naming its holder.

A second job that would write the same checkpoints (one recipe launched twice by mistake) is refused
at start in one line naming the holder, before it trains or prunes anything. A lock whose holder is
gone (no heartbeat for ``checkpoint.lock_timeout_s``, or, on this host, its process no longer there)
is taken over, saying so. A restart of the same job (torchrun's next attempt, ``disttrain-launch
--max-restarts``) takes its own lock back at once: the job is known by ``DISTTRAIN_JOB_ID`` (set by
``disttrain-launch`` for all its attempts) or torchrun's ``TORCHELASTIC_RUN_ID``.

The heartbeat is a wall-clock time written by the holder, so the hosts sharing the directory must
keep their clocks within the timeout of each other (NTP does).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from disttrain_ds.errors import ConfigError

LOCK_NAME = ".disttrain-job.lock"
JOB_ENV = "DISTTRAIN_JOB_ID"
"""A job's identity over its restarts (``disttrain-launch`` sets it once for every attempt)."""


class DirectoryInUse(ConfigError):
    """Another live job holds the directory; one line naming it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a directory."""

    host: str
    """Host name of the holding process."""
    pid: int
    """Its process id on that host."""
    job: str
    """The job's identity over restarts (``job_identity``); empty: none known."""
    started: float
    """When it took the lock (seconds since the epoch)."""
    beat: float
    """Its last heartbeat (seconds since the epoch)."""


def job_identity(env: Mapping[str, str] = os.environ) -> str:
    """The running job's identity over its restarts, or "" when its launcher gives none."""
    for key in (JOB_ENV, "TORCHELASTIC_RUN_ID"):
        value = env.get(key, "")
        if value and value != "none":
            return f"{key}={value}"
    return ""


def pid_alive(pid: int) -> bool:
    """Whether a process of this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def gone_reason(holder: Holder, now: float, timeout_s: float, host: str,
                alive: Callable[[int], bool] = pid_alive) -> str | None:
    """Why ``holder`` no longer holds its lock (its heartbeat is older than ``timeout_s``, or it ran on
    this ``host`` and its process is gone), or None while it does."""
    if now - holder.beat > timeout_s:
        return f"no heartbeat for {now - holder.beat:.0f} s"
    if holder.host == host and not alive(holder.pid):
        return f"its process {holder.pid} on {host} is gone"
    return None


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file names; None if it is unreadable (half-written, damaged)."""
    try:
        data = json.loads(path.read_text())
        return Holder(str(data["host"]), int(data["pid"]), str(data["job"]), float(data["started"]),
                      float(data["beat"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class DirectoryLock:
    """This job's hold on ``directory`` (``what`` names it in messages: ``checkpoint.dir``, ...)."""

    def __init__(self, directory: str | Path, what: str, timeout_s: float, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.time, job: str | None = None):
        self.path = Path(directory) / LOCK_NAME
        self.what, self.timeout_s, self.log, self.clock = what, timeout_s, log, clock
        now = clock()
        self.me = Holder(socket.gethostname(), os.getpid(), job_identity() if job is None else job, now, now)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "DirectoryLock":
        """Take the lock, or stop in one line naming the live job that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return self._take_over()
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(self.me)))
        return self

    def _take_over(self) -> "DirectoryLock":
        holder = read_holder(self.path)
        if holder is None:
            time.sleep(0.2)  # a lock being written this instant
            holder = read_holder(self.path)
        if holder is not None and holder.job and holder.job == self.me.job:
            why = "a restart of the same job"
        elif holder is None:
            why = "its lock file is unreadable"
        else:
            why = gone_reason(holder, self.clock(), self.timeout_s, self.me.host)
            if why is None:
                raise DirectoryInUse(
                    f"{self.what} {self.path.parent} is in use by another job: {describe(holder, self.clock())}; "
                    f"two jobs there would write and prune each other's checkpoints. Stop that job or choose "
                    f"another {self.what} (a lock left by a job that died is taken over after "
                    f"checkpoint.lock_timeout_s = {self.timeout_s:.0f} s)")
        self._write(self.me)
        if read_holder(self.path) != self.me:  # another job took it over in the same instant
            raise DirectoryInUse(f"{self.what} {self.path.parent}: another job took the lock over at the same time")
        self.log(f"{self.what} {self.path.parent}: took the lock over from "
                 f"{describe(holder, self.clock()) if holder else 'an unknown job'} ({why})")
        return self

    def _write(self, holder: Holder) -> None:
        tmp = self.path.with_name(f"{LOCK_NAME}.{self.me.host}.{self.me.pid}.tmp")
        tmp.write_text(json.dumps(asdict(holder)))
        os.replace(tmp, self.path)

    def _mine(self) -> bool:
        """Whether the lock file still names this process's hold (heartbeats aside)."""
        current = read_holder(self.path)
        return current is not None and (current.host, current.pid, current.started) == (
            self.me.host, self.me.pid, self.me.started)

    def beat(self) -> bool:
        """Renew the heartbeat; False (and nothing written) if the lock is no longer this job's."""
        if not self._mine():
            return False
        self._write(Holder(self.me.host, self.me.pid, self.me.job, self.me.started, self.clock()))
        return True

    def start_heartbeat(self, interval_s: float | None = None) -> "DirectoryLock":
        """Renew the heartbeat from a background thread (every quarter of the timeout by default)."""
        interval = interval_s or max(self.timeout_s / 4, 0.05)

        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    if not self.beat():
                        self.log(f"warning: {self.what} {self.path.parent}: the lock is no longer this job's")
                        return
                except OSError:  # a file system hiccup: the next beat tries again
                    continue

        self._thread = threading.Thread(target=run, name=f"lock-{self.what}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._mine():
            self.path.unlink(missing_ok=True)


def describe(holder: Holder, now: float) -> str:
    job = f", job {holder.job}" if holder.job else ""
    return (f"host {holder.host} pid {holder.pid}{job}, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.started))}, "
            f"last heartbeat {max(now - holder.beat, 0):.0f} s ago")


def hold(directory: str | Path, what: str, timeout_s: float, log: Callable[[str], None] = print) -> DirectoryLock:
    """Take ``directory`` for this job and keep its heartbeat going; ``release()`` at the end."""
    return DirectoryLock(directory, what, timeout_s, log).acquire().start_heartbeat()

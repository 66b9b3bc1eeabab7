"""Rank health: when one rank dies or hangs, every other rank stops soon, naming it.

Without this, a killed rank leaves its neighbours blocked in collectives until the process-group
timeout, and ranks of other nodes may wait forever. Each rank runs a watchdog thread that bumps a
heartbeat counter in the job's rendezvous store every ``interval`` seconds and reads everyone
else's. A counter that stops changing for ``timeout`` seconds (a killed, stopped or wedged process)
or a failure note left by a rank makes every rank print one line naming the rank and its module
and exit. Counters, not timestamps, so clocks of different nodes need not agree.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

EXIT_PEER_FAILED = 3
"""Exit code of a rank that stops because another rank failed."""
EXIT_FAILED = 1
"""Exit code of the rank where the failure happened (and of every rank when the loss diverged)."""
DIVERGED_QUIET_S = 2.0
"""How long ranks other than 0 wait before exiting after a non-finite loss (rank 0 reports it)."""


def connect_store(timeout_s: float = 10.0):
    """A client connection of its own to the job's rendezvous store (torchrun's agent or rank 0)."""
    import torch.distributed as tdist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = tdist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return tdist.PrefixStore(f"disttrain/health/{restart}/", store)


class Watchdog:
    """Heartbeats of all ranks, seen from one rank."""

    def __init__(
        self,
        store,
        rank: int,
        names: dict[int, str],
        timeout_s: float,
        interval_s: float = 1.0,
        emit: Callable[[str], None] | None = None,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        self.store, self.rank, self.names = store, rank, names
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.emit = emit or (lambda line: print(line, file=sys.stderr, flush=True))
        self.exit_fn = exit_fn
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value, monotonic time it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        # Without torchrun's agent, rank 0 hosts the store: it lingers before exiting so the
        # others can still read why the job stops.
        self.hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.verdict: str | None = None
        self.step = 0
        """The optimizer step being run (for messages); 0 before training starts."""
        self.failure_dir: str | None = None
        """Where tracebacks of failures go (the run directory, once known)."""

    def who(self, rank: int) -> str:
        return f"rank {rank} ({self.names.get(rank, '?')})"

    def start(self) -> "Watchdog":
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"hb/{self.rank}", str(self._beats))

    def check(self, now: float | None = None) -> str | None:
        """One look at the others: the reason to stop, or None."""
        now = time.monotonic() if now is None else now
        if self.store.check(["fault"]):
            note = self.store.get("fault").decode()
            return note
        others = [r for r in self.names if r != self.rank]
        values = self.store.multi_get([f"hb/{r}" for r in others]) if others else []
        for r, v in zip(others, values):
            last = self._seen.get(r)
            if last is None or last[0] != v:
                self._seen[r] = (v, now)
            elif v != b"done" and now - last[1] > self.timeout_s:
                return f"{self.who(r)} stopped responding (no heartbeat for {now - last[1]:.0f} s: killed, stopped or hung)"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                reason = self.check()
            except Exception as exc:  # noqa: BLE001 - the store itself is gone
                reason = f"the job's rendezvous store is unreachable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the launcher or rank 0 is gone"
            if reason and not self._stop.is_set():
                self.verdict = reason
                self._publish(reason)  # everyone stops for the same, first-found reason
                self.emit(f"{self.who(self.rank)}: stopping{self._at()} because {reason}")
                self._exit(EXIT_PEER_FAILED)
                return

    def blame(self, wait_s: float) -> str | None:
        """After an error on this rank: wait up to ``wait_s`` for a peer to be found dead or failed
        (a neighbour's death usually shows here first as a broken connection)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.verdict:
                return self.verdict
            try:
                reason = self.check()
            except Exception:  # noqa: BLE001
                return None
            if reason:
                return reason
            time.sleep(self.interval_s)
        return None

    def fail(self, line: str) -> None:
        """Publish this rank's failure so every other rank stops naming it."""
        self._stop.set()
        self._publish(f"{self.who(self.rank)} failed: {line}")

    def _publish(self, note: str) -> None:
        try:
            if not self.store.check(["fault"]):
                self.store.set("fault", note)
        except Exception:  # noqa: BLE001 - peers will see the heartbeat stop instead
            pass

    def finished(self) -> None:
        """This rank is done: its silence from now on is not a failure."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
        try:
            self.store.set(f"hb/{self.rank}", "done")
        except Exception:  # noqa: BLE001
            pass

    def handle(self, exc: BaseException, blame_wait_s: float) -> None:
        """End this rank after ``exc`` with one line; returns only for ``ConfigError`` (re-raised by
        the caller so the entry point prints it)."""
        from ..comm.p2p import CommTimeoutError
        from ..configtools import ConfigError
        from .guards import TrainingDiverged

        here = self.who(self.rank)
        if isinstance(exc, ConfigError):
            self.fail(str(exc))
            return
        if isinstance(exc, TrainingDiverged):
            # Every rank saw the same loss at the same step: nobody to blame; rank 0 says it once
            # and the others wait a moment so a launcher does not end rank 0 before it has.
            self.fail(str(exc))
            if self.rank == 0:
                self.emit(f"error: {exc}")
            else:
                time.sleep(DIVERGED_QUIET_S)
            return self._exit(EXIT_FAILED)
        if isinstance(exc, KeyboardInterrupt):
            self.fail("interrupted")
            self.emit(f"{here}: interrupted{self._at()}")
            return self._exit(130)
        line = one_line(exc)
        # A broken connection is usually the neighbour's death: give the heartbeats time to say whose.
        if isinstance(exc, (RuntimeError, OSError)) and not isinstance(exc, CommTimeoutError):
            culprit = self.blame(blame_wait_s)
            if culprit:
                self.emit(f"{here}: stopping{self._at()} because {culprit} (seen here as: {line})")
                return self._exit(EXIT_PEER_FAILED)
        self.fail(line)
        path = self._write_traceback(exc)
        self.emit(f"{here} failed{self._at()}: {line} (traceback: {path})")
        self._exit(EXIT_FAILED)

    def _at(self) -> str:
        return f" at step {self.step}" if self.step else ""

    def _write_traceback(self, exc: BaseException) -> str:
        import tempfile
        import traceback

        text = "".join(traceback.format_exception(exc))
        for base in (os.path.join(self.failure_dir, "failures") if self.failure_dir else None, tempfile.gettempdir()):
            if base is None:
                continue
            try:
                os.makedirs(base, exist_ok=True)
                path = os.path.join(base, f"rank{self.rank:05d}-{os.getpid()}.log")
                with open(path, "w") as f:
                    f.write(text)
                return path
            except OSError:
                continue
        return "unavailable"

    def _exit(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.hosts_store:
            time.sleep(3 * self.interval_s)
        self.exit_fn(code)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, without gloo's source location and advice."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". This is typically")[0]
    return f"{type(exc).__name__}: {first}"

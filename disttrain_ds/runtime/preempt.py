"""Preemption: SIGTERM asks the job to save a checkpoint at the next step boundary and stop.

A scheduler (Slurm, Kubernetes, a spot-instance reclaim) sends SIGTERM and, some time later,
SIGKILL. The handler only records when the signal came; the step loop asks every rank at each step
boundary (a column of the step's all-gather) whether any rank was signalled, so all ranks save the
same step and stop together even when only one of them got the signal. If no boundary is reached
within ``checkpoint.sigterm_grace_s`` the rank exits without saving.

The signal is also noticed by a watcher thread through ``signal.set_wakeup_fd``: the grace period
starts when the signal arrives, even while the main thread is blocked inside a collective (where
Python signal handlers cannot run).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

EXIT_PREEMPTED = 143
"""Exit code after SIGTERM (128 + 15, what a process killed by SIGTERM reports to a shell)."""


class Preemption:
    """SIGTERM bookkeeping of one rank; ``install`` from the main thread."""

    def __init__(self, grace_s: float, on_expire: Callable[[float], None] | None = None):
        self.grace_s = grace_s
        self.on_expire = on_expire or _default_expire
        self.requested_at: float | None = None
        """``time.monotonic()`` when SIGTERM arrived; None if it has not."""
        self._lock = threading.Lock()
        self._handled = threading.Event()
        self._socks: tuple[socket.socket, socket.socket] | None = None
        self._old_handler = None
        self._old_wakeup = -1

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def install(self) -> "Preemption":
        """Catch SIGTERM (only possible in the main thread; elsewhere this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = socket.socketpair()
        r.setblocking(True)
        w.setblocking(False)
        self._socks = (r, w)
        self._old_handler = signal.signal(signal.SIGTERM, self._handler)
        self._old_wakeup = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="disttrain-sigterm", daemon=True).start()
        return self

    def uninstall(self) -> None:
        """Restore the previous SIGTERM handler and wakeup fd (tests)."""
        if self._socks is None:
            return
        signal.signal(signal.SIGTERM, self._old_handler)
        signal.set_wakeup_fd(self._old_wakeup)
        self._handled.set()
        for s in self._socks:
            s.close()
        self._socks = None

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.note()

    def _watch(self) -> None:
        r = self._socks[0] if self._socks else None
        while r is not None:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self.note()

    def note(self, now: float | None = None) -> None:
        """Record a SIGTERM (the first one counts) and start the grace period."""
        with self._lock:
            if self.requested_at is not None:
                return
            self.requested_at = time.monotonic() if now is None else now
        if self.grace_s > 0:
            threading.Thread(target=self._grace, name="disttrain-sigterm-grace", daemon=True).start()

    def _grace(self) -> None:
        if not self._handled.wait(self.grace_s):
            self.on_expire(self.grace_s)

    def handled(self) -> None:
        """The step loop reached a boundary and is stopping: the grace period no longer applies."""
        self._handled.set()


def _default_expire(grace_s: float) -> None:
    print(f"preempted: no step boundary within checkpoint.sigterm_grace_s={grace_s:g} s of SIGTERM; "
          "exiting without a checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PREEMPTED)


KILL_ENV = "DISTTRAIN_KILL_AT"
"""Fault injection for restart tests: ``RANK:STEP`` (or ``RANK,RANK,...:STEP``: a whole node) ends those
ranks abruptly after STEP, first launch only."""


def injected_kill(rank: int, step: int) -> None:
    """``os._exit(9)`` if ``DISTTRAIN_KILL_AT`` names this rank and step and this is not a restart
    (neither torchrun's nor ``disttrain-launch --max-restarts``'s)."""
    spec = os.environ.get(KILL_ENV, "")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" == os.environ.get("DISTTRAIN_LAUNCH_ATTEMPT", "0")
    ranks, _, at = spec.partition(":")
    if spec and first and at == str(step) and str(rank) in ranks.split(","):
        print(f"rank {rank}: {KILL_ENV}={spec}: exiting abruptly", file=sys.stderr, flush=True)
        os._exit(9)

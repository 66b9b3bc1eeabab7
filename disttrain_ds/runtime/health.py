"""Rank health: when one rank dies or hangs, every other rank stops soon, naming it.

Without this, a killed rank leaves its neighbours blocked in collectives until the process-group
timeout, and ranks of other nodes may wait forever. Each rank runs a watchdog thread that bumps a
heartbeat counter in the job's rendezvous store every ``interval`` seconds and reads the counters of
a few other ranks (``runtime/heartbeat.py``: who watches whom) and the job's failure note. A counter
that stops changing for ``timeout`` seconds (a killed, stopped or wedged process), one that does not
appear within the start-up deadline, or a failure note left by a rank makes every rank stop with one
line naming the rank and its module and exit. Once the run directory exists, only one rank prints
that line on the terminal (``runtime/verdict.py``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable

from disttrain_ds.console import Console, tell_launcher
from disttrain_ds.errors import CommTimeoutError, ConfigError, TrainingDiverged
from disttrain_ds.runtime.failures import one_line, waits_for_peer
from disttrain_ds.runtime.heartbeat import Heartbeat, hb_key, stuck_rank
from disttrain_ds.runtime.verdict import Verdict, pointer_line, terminal_line

EXIT_PEER_FAILED = 3
"""Exit code of a rank that stops because another rank failed."""
EXIT_FAILED = 1
"""Exit code of the rank where the failure happened (and of every rank when the loss diverged)."""
DIVERGED_QUIET_S = 2.0
"""How long ranks other than 0 wait before exiting after a non-finite loss (rank 0 reports it)."""
STORE_OP_MAX_S = 10.0
"""Longest a watchdog store operation may block (a stopped store host answers nothing)."""
HOSTS_POLL_S = 0.5
"""How often ``start`` looks whether every rank has announced its host."""
STARTED = "started"
"""Store counter of ranks that announced their host: the host map is read once it is complete."""
HOST_MAP = "hostmap"
"""Every rank's host in one key, written by the rank that completes ``STARTED``: each rank then reads
one key instead of world-many (world^2 reads at start-up otherwise)."""

def connect_store(timeout_s: float = 10.0):
    """A client connection of its own to the job's rendezvous store (torchrun's agent or rank 0)."""
    import torch.distributed as tdist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = tdist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return tdist.PrefixStore(f"disttrain/health/{restart}/", store)


class Watchdog:
    """Heartbeats of the job, seen from one rank: it beats, watches a few ranks and reads the verdict.

    ``startup_timeout_s``: how long a watched rank may take to show its first heartbeat, counted from
    this rank's first look (``parallel.startup_timeout_s``); None: 600 s. Never below ``timeout_s``."""

    def __init__(
        self,
        store,
        rank: int,
        names: dict[int, str],
        timeout_s: float,
        interval_s: float = 1.0,
        emit: Callable[[str], None] | None = None,
        exit_fn: Callable[[int], None] = os._exit,
        console: Console | None = None,
        host: str | None = None,
        startup_timeout_s: float | None = None,
    ):
        self.store, self.rank, self.names = store, rank, names
        self.console = console
        """This rank's library log: once it is in the run directory, lines not shown go there."""
        self.hosts = {rank: host or socket.gethostname()}
        """Host of each rank (filled from the store): who shares a terminal with whom."""
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.emit = emit or (lambda line: print(line, file=sys.stderr, flush=True))
        self.exit_fn = exit_fn
        self.store_host = store_host_name()
        self.store_op_s = max(1.0, min(STORE_OP_MAX_S, timeout_s / 2))
        """Longest wait for one store operation before the store host is declared gone."""
        self._store_lost: str | None = None
        self.heart = Heartbeat(self._op, rank, names, timeout_s, startup_timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        # Without torchrun's agent, rank 0 hosts the store: it lingers before exiting so the
        # others can still read why the job stops.
        self.hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.verdict: Verdict | None = None
        self._ending = threading.Lock()  # one failure line per rank, from whichever thread gets there first
        self._ended = threading.Event()
        self.step = 0
        """The optimizer step being run (for messages); 0 before training starts."""
        self.failure_dir: str | None = None
        """Where tracebacks of failures go (the run directory, once known)."""

    def who(self, rank: int) -> str:
        return f"rank {rank} ({self.names.get(rank, '?')})"

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    def start(self) -> "Watchdog":
        self.announce()
        self._beat()
        self._await_hosts(self.store_op_s)
        self._thread.start()
        return self

    def announce(self) -> None:
        """Leave this rank's host, then count it as started: a complete count means every host is there."""
        self._op("set", f"host/{self.rank}", self.host)
        if int(self._op("add", STARTED, 1)) == len(self.names):  # the last to come writes the map
            order = sorted(self.names)
            hosts = self._op("multi_get", [f"host/{r}" for r in order])
            self._op("set", HOST_MAP, json.dumps([h.decode() for h in hosts]))

    def _await_hosts(self, wait_s: float) -> None:
        """Read every rank's host now, not at the first check: a store that dies early could no
        longer tell who prints. Best effort: ranks usually start their watchdogs together, right
        after the process group forms; if some have not after ``wait_s``, the checks read the map
        once they have."""
        deadline = time.monotonic() + wait_s
        try:
            # Polled, not waited on: a store read abandoned by ``_op`` would spoil the client.
            while not self._learn_hosts() and time.monotonic() < deadline:
                time.sleep(min(HOSTS_POLL_S, self.interval_s))
        except Exception:  # noqa: BLE001 - the heartbeats will tell what the store does
            pass

    def _learn_hosts(self) -> bool:
        """Whether every rank's host is known, reading them all once every rank has announced itself
        (until then one counter read: not world-many keys per look)."""
        if len(self.hosts) >= len(self.names):
            return True
        if int(self._op("add", STARTED, 0)) < len(self.names) or not self._op("check", [HOST_MAP]):
            return False
        for r, h in zip(sorted(self.names), json.loads(self._op("get", HOST_MAP))):
            self.hosts.setdefault(r, h)
        return True

    def _op(self, name: str, *args):
        """``store.<name>(*args)``, given up after ``store_op_s`` (a stopped store host never answers:
        the client blocks whatever its timeout says)."""
        if self._store_lost:
            raise ConnectionError(self._store_lost)
        box: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = getattr(self.store, name)(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="disttrain-store-op", daemon=True).start()
        if not done.wait(self.store_op_s):
            raise TimeoutError(f"no answer to a store {name} in {self.store_op_s:.0f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _beat(self) -> None:
        self.heart.beat()

    def stuck_peer(self, peer: int) -> tuple[int, list[int]]:
        """(the rank at the end of the chain of transfers waiting from ``peer`` on, the chain), from
        the peers' beats; ``peer`` itself if the store cannot tell."""
        def read(r: int) -> bytes | None:
            return self._op("get", hb_key(r)) if self._op("check", [hb_key(r)]) else None

        try:
            return stuck_rank(peer, read, limit=len(self.names))
        except Exception:  # noqa: BLE001 - the store is gone: the peer the deadline ran out on
            return peer, [peer]

    def check(self, now: float | None = None) -> Verdict | None:
        """One look: the job's verdict if one was published, else the reason to stop found among the
        ranks this one watches, or None. A bounded number of store reads whatever the world size."""
        now = time.monotonic() if now is None else now
        if self._op("check", ["fault"]):
            return Verdict.decode(self._op("get", "fault"))
        self._learn_hosts()
        silent = self.heart.look(now)
        return Verdict(f"{self.who(silent.rank)} {silent.reason}", failed=silent.rank) if silent else None

    def store_lost(self, exc: BaseException) -> Verdict:
        """The verdict after a store operation failed or timed out: the store host is gone."""
        if self._store_lost is None:
            self._store_lost = f"{self.store_host} stopped responding ({one_line(exc)})"
        return self._lost()

    def _lost(self) -> Verdict:
        # Nobody can publish it: each host's lowest rank prints it (verdict.role), rank 0 excepted
        # when it hosts the store, as its silence is the failure.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return Verdict(self._store_lost or "", failed=None if agent else 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                reason = self.check()
            except Exception as exc:  # noqa: BLE001 - the store itself is gone
                reason = self.store_lost(exc)
            if reason and not self._stop.is_set():
                self.verdict = v = self._publish(reason)  # everyone stops for the same, first-found reason
                self._end(v, f"{self.who(self.rank)}: stopping{self._at()} because {v.cause}", EXIT_PEER_FAILED)
                return

    def blame(self, wait_s: float) -> Verdict | None:
        """After an error on this rank: wait up to ``wait_s`` for a peer to be found dead or failed
        (a neighbour's death usually shows here first as a broken connection)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.verdict:
                return self.verdict
            if self._store_lost:
                return self._lost()
            try:
                reason = self.check()
            except Exception as exc:  # noqa: BLE001 - the store host is gone: that is the culprit
                return self.store_lost(exc)
            if reason:
                return reason
            time.sleep(self.interval_s)
        return None

    def fail(self, line: str) -> Verdict:
        """Publish this rank's failure so every other rank stops naming it; returns the verdict that
        stands (another rank's, when it published first)."""
        self._stop.set()
        return self._publish(Verdict(f"{self.who(self.rank)} failed: {line}", failed=self.rank))

    def _publish(self, v: Verdict) -> Verdict:
        """Store ``v`` as the job's verdict unless one is there; returns the one that stands."""
        if self._store_lost or v.by is not None:
            return v  # nobody can read it (each try would block for the store timeout), or already there
        mine = replace(v, by=self.rank, host=self.host, log=self._log_file())
        try:  # atomic: of ranks publishing at once, exactly one wins and prints the cause
            return Verdict.decode(self._op("compare_set", "fault", "", mine.encode()))
        except Exception:  # noqa: BLE001 - peers will see the heartbeat stop instead
            return v

    def _log_file(self) -> str | None:
        """This rank's log, once in the run directory; None before (every rank then prints, as before)."""
        c = self.console
        return str(c.log_path) if c is not None and c.in_run_dir and c.log_path is not None else None

    def _end(self, v: Verdict, line: str, code: int) -> None:
        """Say ``line`` (the terminal or the log, see ``_say``) and exit with ``code``, once per rank:
        the watchdog thread and the failing main thread may both get here."""
        if not self._ending.acquire(blocking=False):
            self._ended.wait(30)  # the other thread is ending the process
            return
        self._say(v, line)
        self._exit(code)
        self._ended.set()  # only reached with a test's exit_fn

    def _say(self, v: Verdict, line: str) -> None:
        log = self._log_file()
        if log is None:  # run directory not known yet (failure before set-up): every rank prints its line
            self.emit(line)
            return
        self.console.log(line)  # the full line, cause included, is kept whatever the terminal shows
        failed = self.who(v.failed) if v.failed is not None else ""
        pointer = pointer_line(v, self.who(self.rank), self._at(), failed, self.hosts, log)
        shown = terminal_line(v, self.rank, self.hosts, line, pointer)
        if shown is None:
            tell_launcher(pointer, later=True)  # torchrun's summary: a line without the cause, not its root
        else:
            self.emit(shown)

    def finished(self) -> None:
        """This rank is done: its silence from now on is not a failure."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
        if self._store_lost:
            return
        try:
            self.heart.finish()
        except Exception:  # noqa: BLE001
            pass

    def handle(self, exc: BaseException, blame_wait_s: float) -> None:
        """End this rank after ``exc`` with one line; returns only for ``ConfigError`` (re-raised by
        the caller so the entry point prints it)."""
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
        if isinstance(exc, CommTimeoutError) and exc.peer is not None:
            # A dead peer would have been named by the heartbeats long before this deadline: it is
            # alive, and either stuck or itself waiting for another rank; blame the end of that chain.
            culprit, chain = self.stuck_peer(exc.peer)
            via = f", which waits for {', '.join(self.who(r) for r in chain[:-1])}" if len(chain) > 1 else ""
            v = self._publish(Verdict(f"{self.who(culprit)} did not answer in time ({line}{via})", failed=culprit))
            return self._end(v, f"{here}: stopping{self._at()} because {v.cause}", EXIT_PEER_FAILED)
        # A broken connection is usually the neighbour's death: give the heartbeats time to say whose.
        # A local error (disk full, unreadable file, a check of ours) is reported at once.
        if waits_for_peer(exc) and not isinstance(exc, CommTimeoutError):
            culprit = self.blame(blame_wait_s)
            if culprit:
                v = self._publish(culprit)
                return self._end(v, f"{here}: stopping{self._at()} because {v.cause} (seen here as: {line})",
                                 EXIT_PEER_FAILED)
        v = self.fail(line)
        path = self._write_traceback(exc)
        self._end(v, f"{here} failed{self._at()}: {line} (traceback: {path})", EXIT_FAILED)

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


def store_host_name() -> str:
    """How messages name the host of the job's rendezvous store."""
    host = os.environ.get("MASTER_ADDR", "?")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"the launcher's rendezvous store (host {host})"
    return f"the store host (rank 0, host {host})"

"""Heartbeats that scale: who reads whose counter, and how one rank judges what it reads.

Every rank bumps its counter ``hb/<rank>`` in the job's store once per interval. Reading every
other rank's counter from every rank would cost the store world^2 reads per interval (a million a
second at 1,024 ranks), so each rank reads only the counters of the next ``WATCHERS`` ranks in rank
order (a ring that wraps at the end), plus the job's ``fault`` key (``runtime/health.py``): a few
reads per rank per interval whatever the world size. Each rank is thus watched by the ``WATCHERS``
ranks before it; whoever finds it silent publishes the verdict in ``fault``, which every rank reads.

The ring needs no host map, so every rank knows its place from the first beat, even with ranks that
start late. Launchers number a host's ranks consecutively, so most ranks are watched from their own
host, and each host's first ranks from the host before it: a host that dies whole is still named.
Any set of silent ranks short of all of them holds one whose predecessor still runs, so a failure
is always found. A rank that finished (``done``) leaves the ring: its watchers move on to the next
rank still running, so the ring stays closed until the end.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

WATCHERS = 2
"""Ranks watching each rank. One suffices to find a failure; a second names a hung rank as soon as
the first would, even when that first watcher is itself slow or stopped."""
DONE = b"done"
"""A finished rank's counter: its silence from then on is no failure."""
DEFAULT_STARTUP_TIMEOUT_S = 600.0
"""Start-up deadline when none is given (``parallel.startup_timeout_s``)."""

StoreOp = Callable[..., Any]
"""``op(name, *args)``: run ``store.<name>(*args)`` (``Watchdog._op``, which gives up on a stopped store)."""


def hb_key(rank: int) -> str:
    return f"hb/{rank}"


def beat_value(count: int, waiting_on: int | None) -> str:
    """A counter, and the peer this rank's transfer is waiting for, if it waits (``"12 w5"``)."""
    return str(count) if waiting_on is None else f"{count} w{waiting_on}"


def waits_on(value: bytes | None) -> int | None:
    """The peer a beat says its rank waits for, or None."""
    if not value or b" w" not in value:
        return None
    try:
        return int(value.rsplit(b" w", 1)[1])
    except ValueError:
        return None


def stuck_rank(first: int, read: Callable[[int], bytes | None], limit: int) -> tuple[int, list[int]]:
    """Follow "waits for" from ``first`` (the peer a deadline ran out on) to a rank that is not
    itself waiting for a transfer: that one is stuck, the ranks before it merely wait in a chain.
    Returns (the rank to blame, the chain followed). A loop of waits (a deadlock) blames ``first``."""
    chain = [first]
    for _ in range(limit):
        nxt = waits_on(read(chain[-1]))
        if nxt is None:
            return chain[-1], chain
        if nxt in chain:
            return first, chain
        chain.append(nxt)
    return first, chain


def watched_ranks(rank: int, order: Sequence[int], skip: Collection[int] = (), count: int = WATCHERS) -> list[int]:
    """The ranks whose counters ``rank`` reads: the next ``count`` ranks after it in ``order``
    (every rank of the job, ascending), wrapping at the end and passing over ``skip`` (finished
    ranks). Fewer when fewer others are left; never ``rank`` itself."""
    out: list[int] = []
    start = bisect.bisect_right(order, rank)
    for step in range(len(order)):
        r = order[(start + step) % len(order)]
        if r == rank or len(out) == count:
            break
        if r not in skip:
            out.append(r)
    return out


@dataclass(frozen=True)
class Silence:
    """A watched rank found silent too long."""

    rank: int
    reason: str
    """What follows the rank's name in the failure line: ``stopped responding (...)``, ``did not start ...``."""


class Heartbeat:
    """One rank's counter, and its view of the ranks it watches (``watched_ranks``).

    A watched rank whose counter has not appeared yet has not started: its silence is held against
    ``startup_timeout_s``, counted from this rank's first look, so a rank that comes up late (a slow
    node, a launcher that starts nodes apart) does not stop the others. Once seen, a counter that stops
    changing for ``timeout_s`` is a killed, stopped or hung rank. Counters, not timestamps, so clocks
    of different hosts need not agree."""

    def __init__(self, op: StoreOp, rank: int, ranks: Collection[int], timeout_s: float,
                 startup_timeout_s: float | None = None, watchers: int = WATCHERS):
        self.op, self.rank, self.watchers = op, rank, watchers
        # Every rank of the job: 0..world-1 as a range (no list per watcher of world entries).
        self.order: Sequence[int] = range(len(ranks)) if _is_range(ranks) else sorted(ranks)
        self.timeout_s = timeout_s
        # A rank that has not started is never given less time than one that stopped beating.
        self.startup_timeout_s = max(timeout_s, DEFAULT_STARTUP_TIMEOUT_S if startup_timeout_s is None
                                     else startup_timeout_s)
        self.beats = 0
        self.seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value, time it changed)
        self.done: set[int] = set()
        self.since: float | None = None
        """Time of the first look: where the start-up deadline counts from."""
        self.waiting: Callable[[], int | None] = lambda: None
        """The peer this rank's transfer waits for now (``P2P.waiting_on``), beaten along with the count."""

    def beat(self) -> None:
        self.beats += 1
        self.op("set", hb_key(self.rank), beat_value(self.beats, self.waiting()))

    def finish(self) -> None:
        self.op("set", hb_key(self.rank), DONE.decode())

    def targets(self) -> list[int]:
        return watched_ranks(self.rank, self.order, self.done, self.watchers)

    def look(self, now: float) -> Silence | None:
        """Read the watched ranks' counters once: the first rank silent too long, or None."""
        if self.since is None:
            self.since = now
        targets = self.targets()
        # A store read of a key not written yet blocks until the key appears: check those first.
        present = [r for r in targets if r in self.seen or self.op("check", [hb_key(r)])]
        values = self.op("multi_get", [hb_key(r) for r in present]) if present else []
        got = dict(zip(present, values))
        for r in targets:
            silent = self._judge(r, got.get(r) or None, now)
            if silent:
                return silent
        return None

    def _judge(self, r: int, value: bytes | None, now: float) -> Silence | None:
        if value is None:
            if now - self.since > self.startup_timeout_s:
                return Silence(r, f"did not start within {self.startup_timeout_s:.0f} s")
            return None
        if value == DONE:
            self.done.add(r)  # from the next look on, the next rank still running takes its place
            self.seen.pop(r, None)
            return None
        last = self.seen.get(r)
        if last is None or last[0] != value:
            self.seen[r] = (value, now)
        elif now - last[1] > self.timeout_s:
            why = f"no heartbeat for {now - last[1]:.0f} s: killed, stopped or hung"
            return Silence(r, f"stopped responding ({why})")
        return None


def _is_range(ranks: Collection[int]) -> bool:
    return len(ranks) > 0 and min(ranks) == 0 and max(ranks) == len(ranks) - 1  # distinct: so 0..len-1

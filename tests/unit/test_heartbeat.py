"""Heartbeats that scale: the watch ring (pure), and whole simulated jobs of up to 4,096 watchdogs
on one dict-backed store that counts each rank's reads and writes, driven one simulated second at
a time (no threads, no processes)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.health import Watchdog
from disttrain_ds.runtime.heartbeat import WATCHERS, Heartbeat, watched_ranks
from disttrain_ds.runtime.verdict import Verdict

# The watch ring, pure.


@pytest.mark.parametrize("world", [1, 2, 3, 8, 64])
def test_every_rank_is_watched_by_the_ranks_before_it(world):
    order = range(world)
    watchers: dict[int, list[int]] = {r: [] for r in order}
    for r in order:
        targets = watched_ranks(r, order)
        assert len(targets) == min(WATCHERS, world - 1) and r not in targets
        for t in targets:
            watchers[t].append(r)
    for r in order:
        assert sorted(watchers[r]) == sorted({(r - d) % world for d in range(1, WATCHERS + 1)} - {r})


def test_a_hosts_first_rank_is_watched_from_the_host_before_it():
    assert [r for r in range(64) if 8 in watched_ranks(r, range(64))] == [6, 7]
    assert watched_ranks(63, range(64)) == [0, 1]  # the ring wraps: the last host watches the first


def test_finished_ranks_are_passed_over_so_the_ring_stays_closed():
    assert watched_ranks(1, range(8), skip={2, 3}) == [4, 5]
    assert watched_ranks(6, range(8), skip={7, 0, 1}) == [2, 3]
    assert watched_ranks(0, range(4), skip={1, 2, 3}) == []


def test_ranks_need_not_be_numbered_from_zero():
    assert watched_ranks(5, [1, 5, 9]) == [9, 1]
    assert Heartbeat(lambda *a: None, 5, {1: "a", 5: "b", 9: "c"}, 10).targets() == [9, 1]


def test_the_start_up_deadline_defaults_to_600_s_and_is_never_below_the_heartbeat_timeout():
    assert Heartbeat(lambda *a: None, 0, range(4), 10).startup_timeout_s == 600
    assert Heartbeat(lambda *a: None, 0, range(4), 10, startup_timeout_s=5).startup_timeout_s == 10
    assert Watchdog(CountingStore().client(0), 0, {0: "m"}, 10, startup_timeout_s=90).heart.startup_timeout_s == 90


def test_a_start_up_deadline_of_zero_is_refused():
    with pytest.raises(ConfigError, match="parallel.startup_timeout_s"):
        load_recipe("recipes/tiny_cpu.yaml", ["parallel.startup_timeout_s=0"])


# Simulated jobs.


class CountingStore:
    """The job's store as a dict, counting the keys each rank reads and writes."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.reads: Counter[int] = Counter()
        self.writes: Counter[int] = Counter()

    def client(self, rank: int) -> "Client":
        return Client(self, rank)


class Client:
    """One rank's connection to a ``CountingStore``."""

    def __init__(self, store: CountingStore, rank: int):
        self.s, self.rank = store, rank

    def _read(self, keys: list[str]) -> None:
        self.s.reads[self.rank] += len(keys)

    def set(self, k: str, v: str) -> None:
        self.s.writes[self.rank] += 1
        self.s.data[k] = v.encode()

    def get(self, k: str) -> bytes:
        return self.multi_get([k])[0]

    def check(self, keys: list[str]) -> bool:
        self._read(keys)
        return all(k in self.s.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._read(keys)
        missing = [k for k in keys if k not in self.s.data]
        assert not missing, f"rank {self.rank} read {missing} before they were written (a real store blocks)"
        return [self.s.data[k] for k in keys]

    def add(self, k: str, n: int) -> int:
        self._read([k])
        self.s.writes[self.rank] += n != 0
        self.s.data[k] = str(int(self.s.data.get(k, b"0")) + n).encode()
        return int(self.s.data[k])

    def compare_set(self, k: str, expected: str, desired: str) -> bytes:
        self._read([k])
        if (k not in self.s.data and expected == "") or self.s.data.get(k) == expected.encode():
            self.s.writes[self.rank] += 1
            self.s.data[k] = desired.encode()
        return self.s.data.get(k, expected.encode())


class DirectWatchdog(Watchdog):
    def _op(self, name: str, *args):  # a dict in memory: no store host to give up on, no thread per operation
        return getattr(self.store, name)(*args)


PER_HOST = 8
TIMEOUT = 10


def name(rank: int) -> str:
    return f"llm stage {rank % 4} dp {rank // 4}"


class Job:
    """One watchdog per rank on one counting store; ``run`` advances simulated seconds, each rank
    beating and looking once per second as its watchdog thread would, and publishing what it finds."""

    def __init__(self, world: int, startup_timeout_s: float | None = None, late: dict[int, float] | None = None):
        self.store = CountingStore()
        names = {r: name(r) for r in range(world)}
        hosts = {r: f"node{r // PER_HOST}" for r in range(world)}
        self.dogs = {r: DirectWatchdog(self.store.client(r), r, names, TIMEOUT, emit=lambda _: None, host=hosts[r],
                                       startup_timeout_s=startup_timeout_s) for r in range(world)}
        for w in self.dogs.values():
            w.hosts.update(hosts)  # the host map only says who prints; reading it once is tested in test_health.py
        self.late = late or {}
        self.up: set[int] = set()
        self.gone: dict[int, float] = {}
        """Ranks killed or hung, from that second on."""
        self.finished: set[int] = set()
        self.stopped: dict[int, tuple[float, Verdict]] = {}
        """Ranks stopped by their watchdog: when, and the verdict that stood."""

    def run(self, start: int, stop: int) -> None:
        for now in range(start, stop):
            for r, w in self.dogs.items():
                if r in self.stopped or r in self.finished or self.gone.get(r, now + 1) <= now:
                    continue
                if r not in self.up:
                    if self.late.get(r, 0) > now:
                        continue
                    self.up.add(r)
                    w.announce()  # Watchdog.start, less its thread
                w._beat()
                v = w.check(now=float(now))
                if v is not None:
                    self.stopped[r] = (now, w._publish(v))

    def running(self) -> set[int]:
        return self.up - set(self.gone) - self.finished - set(self.stopped)

    def verdict(self) -> Verdict:
        """The one verdict every stopped rank holds."""
        verdicts = {v for _, v in self.stopped.values()}
        assert len(verdicts) == 1, verdicts
        return verdicts.pop()


def _reads_per_rank_per_second(world: int, seconds: int) -> tuple[float, float, float, float]:
    """(mean and most store keys read per rank per second, most writes, and the extra keys the rank
    that wrote the host map read once, per rank of the world), start-up included."""
    job = Job(world)
    job.run(0, seconds)
    assert not job.stopped
    reads = [job.store.reads[r] for r in range(world)]
    writer = max(range(world), key=reads.__getitem__)  # the last to announce reads every host once
    others = max(reads[r] for r in range(world) if r != writer)
    return (round(sum(reads) / world / seconds, 6), others / seconds, max(job.store.writes.values()) / seconds,
            (reads[writer] - others) / world)


def test_store_reads_per_rank_per_second_do_not_grow_with_the_world():
    seconds = 10
    rates = {world: _reads_per_rank_per_second(world, seconds) for world in (1024, 4096)}
    assert rates[1024] == rates[4096]  # the same for every rank, at both sizes
    mean, most, writes, map_reads = rates[4096]
    assert map_reads == 1.0  # one rank reads each rank's host once: O(world) for the job, not world^2
    # Each second: the fault key and WATCHERS counters; once: the start count and a check per watched key.
    assert most == pytest.approx(1 + WATCHERS + (1 + WATCHERS) / seconds)
    # A beat a second; once: the host and the start count (and the host map, on the last rank to start).
    assert writes == pytest.approx(1 + 3 / seconds)
    assert most < 4 < 4095  # reading every other rank's counter was world - 1 a second


def _assert_named(job: Job, rank: int, reason: str, by: set[int], died: float) -> None:
    """Every running rank stopped within the heartbeat timeout and 3 s of ``died``, on a verdict
    naming ``rank``, found and published by one of ``by``."""
    v = job.verdict()
    assert re.fullmatch(rf"rank {rank} \({re.escape(name(rank))}\) {reason}", v.cause), v.cause
    assert v.failed == rank and v.by in by
    assert not job.running()
    times = [t for t, _ in job.stopped.values()]
    assert died + TIMEOUT <= min(times) and max(times) <= died + TIMEOUT + 3, (min(times), max(times))


STOPPED = r"stopped responding \(no heartbeat for 1\d s: killed, stopped or hung\)"


def test_a_dead_rank_is_named_by_its_watchers_and_every_rank_stops():
    job = Job(64)
    job.gone[5] = 3
    job.run(0, 3 + TIMEOUT - 1)
    assert not job.stopped  # not before the timeout
    job.run(3 + TIMEOUT - 1, 40)
    _assert_named(job, 5, STOPPED, {3, 4}, 3)


def test_a_hosts_lowest_rank_is_named_from_the_host_before_it():
    job = Job(64)
    job.gone[8] = 3  # node1's first rank (where host-wide duties such as printing fall)
    job.run(0, 40)
    _assert_named(job, 8, STOPPED, {6, 7}, 3)


def test_a_host_that_dies_whole_is_named_by_its_first_rank():
    job = Job(64)
    job.gone.update(dict.fromkeys(range(8, 16), 3))  # all of node1
    job.run(0, 40)
    _assert_named(job, 8, STOPPED, {6, 7}, 3)


def test_a_rank_that_never_starts_is_named_after_the_start_up_deadline():
    job = Job(64, startup_timeout_s=60, late={20: 10_000})
    job.run(0, 60)
    assert not job.stopped  # far past the heartbeat timeout: it may still come
    job.run(60, 80)
    _assert_named(job, 20, "did not start within 60 s", {18, 19}, 60 - TIMEOUT)


def test_a_rank_that_starts_late_within_the_deadline_stops_nobody_then_is_held_to_the_heartbeat_timeout():
    job = Job(64, startup_timeout_s=60, late={20: 45, 21: 59})
    job.run(0, 150)
    assert not job.stopped and job.running() == set(range(64))
    job.gone[21] = 150
    job.run(150, 190)
    _assert_named(job, 21, STOPPED, {19, 20}, 150)


def test_a_hung_rank_whose_watchers_finished_is_named_by_the_next_running_rank():
    job = Job(16)
    job.run(0, 5)
    for r in (2, 3):
        job.dogs[r].heart.finish()
        job.finished.add(r)
    job.gone[4] = 5
    job.run(5, 40)
    _assert_named(job, 4, STOPPED, {1}, 5)  # rank 1 passes over 2 and 3


def test_a_job_that_finishes_stops_nobody():
    job = Job(16)
    job.run(0, 5)
    for r in range(16):
        job.dogs[r].heart.finish()
    job.finished.update(range(16))
    assert all(w.check(now=100.0) is None for w in job.dogs.values())


def test_beats_carry_the_peer_a_blocked_transfer_waits_for():
    from disttrain_ds.runtime.heartbeat import beat_value, waits_on

    assert beat_value(7, None) == "7" and waits_on(b"7") is None
    assert beat_value(7, 12) == "7 w12" and waits_on(b"7 w12") == 12
    assert waits_on(b"done") is None and waits_on(None) is None


def test_a_chain_of_waits_is_followed_to_the_rank_that_is_stuck():
    from disttrain_ds.runtime.heartbeat import stuck_rank

    beats = {1: b"40 w2", 2: b"41", 3: b"39 w1"}  # 3 waits for 1, 1 for 2; 2 waits for nobody
    assert stuck_rank(1, beats.get, limit=8) == (2, [1, 2])
    assert stuck_rank(2, beats.get, limit=8) == (2, [2])
    loop = {1: b"5 w2", 2: b"5 w1"}  # a deadlock: blame the peer the deadline ran out on
    assert stuck_rank(1, loop.get, limit=8)[0] == 1

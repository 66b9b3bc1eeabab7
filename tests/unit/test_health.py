"""The watchdog's verdicts on a fake store and a fake clock (no processes), and which rank shows
a verdict's cause on the terminal."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as tdist

from disttrain_ds.errors import ConfigError
from disttrain_ds.runtime.failures import one_line, waits_for_peer
from disttrain_ds.runtime.health import EXIT_FAILED, EXIT_PEER_FAILED, Watchdog
from disttrain_ds.runtime.verdict import Verdict, pointer_line, role, terminal_line


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def compare_set(self, k, expected, desired):  # TCPStore's: set when absent and expected is ""
        with self.lock:
            if (k not in self.data and expected == "") or self.data.get(k) == expected.encode():
                self.data[k] = desired.encode()
            return self.data.get(k, expected.encode())

    def set(self, k, v):
        self.data[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.data[k]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data.get(k, b"") for k in keys]

    def add(self, k, n):
        with self.lock:
            self.data[k] = str(int(self.data.get(k, b"0")) + n).encode()
            return int(self.data[k])


NAMES = {0: "encoder stage 0 dp 0", 1: "llm stage 0 dp 0", 2: "generator stage 0 dp 0"}


def dog(store, rank=0, **kw):
    return Watchdog(store, rank, NAMES, timeout_s=10, emit=kw.pop("emit", lambda _: None), **kw)


def test_a_silent_peer_is_named_only_after_the_timeout():
    store = FakeStore()
    w = dog(store)
    for r in NAMES:
        store.set(f"hb/{r}", "1")
    assert w.check(now=0.0) is None
    store.set("hb/1", "2")  # rank 1 keeps beating, rank 2 went silent
    assert w.check(now=9.0) is None
    store.set("hb/1", "3")
    verdict = w.check(now=10.5)
    assert verdict and "rank 2 (generator stage 0 dp 0) stopped responding" in verdict.cause and verdict.failed == 2


def test_a_finished_peer_is_not_a_failure():
    store = FakeStore()
    w = dog(store)
    store.set("hb/1", "done")
    store.set("hb/2", "done")
    assert w.check(now=0.0) is None and w.check(now=100.0) is None


def test_a_published_failure_stops_everyone_with_its_note():
    store = FakeStore()
    failing, other = dog(store, rank=1), dog(store, rank=2)
    failing.fail("ValueError: bad batch")
    verdict = other.check(now=0.0)
    assert verdict.cause == "rank 1 (llm stage 0 dp 0) failed: ValueError: bad batch"
    assert (verdict.failed, verdict.by) == (1, 1)


def test_handle_blames_a_dead_neighbour_for_a_broken_connection():
    store, lines, codes = FakeStore(), [], []
    w = dog(store, emit=lines.append, exit_fn=codes.append, interval_s=0.01)
    store.set("fault", Verdict("rank 2 (generator stage 0 dp 0) stopped responding", 2, by=1).encode())
    w.handle(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. This is typically x"), 1.0)
    assert codes == [EXIT_PEER_FAILED]
    assert "because rank 2 (generator stage 0 dp 0) stopped responding" in lines[0]
    assert "seen here as: RuntimeError: Read error [127.0.0.1]:1: Connection reset by peer" in lines[0]


def test_handle_blames_the_peer_a_deadline_waited_for_not_the_waiting_rank():
    from disttrain_ds.errors import CommTimeoutError

    store, lines, codes = FakeStore(), [], []
    w = dog(store, rank=0, emit=lines.append, exit_fn=codes.append)
    w.handle(CommTimeoutError("rank 0 (encoder stage 0 dp 0) waited 8 s for gradient of microbatch 1 from rank 1", 1), 1.0)
    assert codes == [EXIT_PEER_FAILED]
    published = Verdict.decode(store.get("fault"))
    assert published.failed == 1 and published.cause.startswith("rank 1 (llm stage 0 dp 0) did not answer in time")
    assert "because rank 1 (llm stage 0 dp 0) did not answer" in lines[0]


def test_handle_blames_the_end_of_a_chain_of_waiting_ranks():
    """Rank 0 ran out of time waiting for rank 1, which itself waits for rank 2: rank 2 is blamed."""
    from disttrain_ds.errors import CommTimeoutError

    store, lines, codes = FakeStore(), [], []
    store.set("hb/1", "30 w2")
    store.set("hb/2", "31")
    w = dog(store, rank=0, emit=lines.append, exit_fn=codes.append)
    w.handle(CommTimeoutError("rank 0 waited 8 s for gradient of microbatch 1 from rank 1", 1), 1.0)
    published = Verdict.decode(store.get("fault"))
    assert published.failed == 2, published
    assert "rank 2 (generator stage 0 dp 0) did not answer" in lines[0]
    assert "which waits for rank 1 (llm stage 0 dp 0)" in lines[0]


def test_handle_without_a_known_peer_reports_the_timeout_as_this_ranks_failure(tmp_path):
    """Negative control: a deadline that names no peer blames nobody else."""
    from disttrain_ds.errors import CommTimeoutError

    store, lines, codes = FakeStore(), [], []
    w = dog(store, rank=0, emit=lines.append, exit_fn=codes.append)
    w.failure_dir = str(tmp_path)
    w.handle(CommTimeoutError("waited 8 s"), 1.0)
    assert codes == [EXIT_FAILED] and Verdict.decode(store.get("fault")).failed == 0


def test_handle_reports_a_local_bug_as_this_ranks_failure(tmp_path):
    store, lines, codes = FakeStore(), [], []
    w = dog(store, rank=1, emit=lines.append, exit_fn=codes.append)
    w.failure_dir, w.step = str(tmp_path), 7
    w.handle(KeyError("mb"), 0.0)
    assert codes == [EXIT_FAILED]
    assert lines[0].startswith("rank 1 (llm stage 0 dp 0) failed at step 7: KeyError: 'mb' (traceback: ")
    assert Verdict.decode(store.get("fault")).cause.startswith("rank 1 (llm stage 0 dp 0) failed: KeyError")
    assert list((tmp_path / "failures").glob("rank00001-*.log"))


@pytest.mark.parametrize("text,expected", [("", "OSError"), ("a\nb", "OSError: a")])
def test_one_line_keeps_the_first_line(text, expected):
    assert one_line(OSError(text)) == expected


class HungStore(FakeStore):
    """A store whose host was stopped: every operation blocks."""

    def check(self, keys):
        time.sleep(60)

    def set(self, k, v):
        time.sleep(60)


class DeadStore(FakeStore):
    """A store whose host was killed: every operation fails."""

    def check(self, keys):
        raise RuntimeError("Connection reset by peer")

    set = check


def test_a_stopped_store_host_is_named_within_the_store_op_limit():
    w = Watchdog(HungStore(), 1, NAMES, timeout_s=2, emit=lambda _: None)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        w.check()
    assert time.monotonic() - t0 < 2.0  # store_op_s = max(1, timeout / 2)


def test_handle_blames_the_store_host_when_the_store_is_gone(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    lines, codes = [], []
    w = dog(DeadStore(), rank=2, emit=lines.append, exit_fn=codes.append, interval_s=0.01)
    w.handle(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"), 5.0)
    assert codes == [EXIT_PEER_FAILED]
    assert "because the store host (rank 0, host 10.0.0.5) stopped responding" in lines[0]
    assert "failed" not in lines[0].split("because")[0]


def test_the_watchdog_thread_stops_the_rank_when_the_store_host_stops(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "h0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    lines, codes = [], []
    w = Watchdog(FakeStore(), 1, NAMES, timeout_s=2, interval_s=0.05, emit=lines.append, exit_fn=codes.append)
    w.start()
    w.store = HungStore()
    deadline = time.monotonic() + 5
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert codes == [EXIT_PEER_FAILED]
    assert lines == [lines[0]] and "because the store host (rank 0, host h0) stopped responding" in lines[0]


class ProjectError(RuntimeError):
    __module__ = "disttrain_ds.data.producers"


@pytest.mark.parametrize("exc,waits", [
    (OSError(errno.ENOSPC, "No space left on device", "/ckpt/x"), False),
    (PermissionError(errno.EACCES, "Permission denied", "/data/a.tar"), False),
    (OSError(errno.EROFS, "Read-only file system", "/ckpt"), False),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/a.jsonl"), False),
    (ValueError("data.path: bad record"), False),
    (ConfigError("train.resume: damaged"), False),
    (ProjectError("data.producers: producer 0 stopped making progress (peer timeout)"), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"), True),
    (RuntimeError("Connection closed by peer [127.0.0.1]:5000"), True),
    (RuntimeError("NCCL communicator was aborted"), True),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), True),
    (OSError(errno.EPIPE, "Broken pipe"), True),
    (TimeoutError("Socket Timeout"), True),
    (tdist.DistNetworkError("failed to recv"), True),
    (OSError("incomplete: 2 written files not found"), True),
])
def test_only_connection_errors_wait_for_a_peer_to_blame(exc, waits):
    assert waits_for_peer(exc) is waits


def test_a_local_os_error_ends_the_rank_at_once(tmp_path):
    store, lines, codes = FakeStore(), [], []
    for r in NAMES:
        store.set(f"hb/{r}", "1")  # every peer alive: a blame wait would run its full length
    w = dog(store, rank=1, emit=lines.append, exit_fn=codes.append, interval_s=0.05)
    w.failure_dir = str(tmp_path)
    t0 = time.monotonic()
    w.handle(OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_5/model.pt"), 25.0)
    assert time.monotonic() - t0 < 5.0
    assert codes == [EXIT_FAILED]
    assert "rank 1 (llm stage 0 dp 0) failed: OSError: No space left on device" in lines[0]


# Who prints what: the cause once per job on one host, a pointer on each other host.

TWO_HOSTS = {0: "a", 1: "a", 2: "b", 3: "b"}


def _roles(v: Verdict, hosts: dict[int, str]) -> dict[int, str]:
    return {r: role(v, r, hosts) for r in hosts if r != v.failed or v.by == r}


def test_the_publisher_prints_the_cause_and_the_ranks_of_its_host_only_log_it():
    v = Verdict("rank 1 (x) failed: KeyError", failed=1, by=1, host="a")
    assert _roles(v, dict.fromkeys(range(8), "a")) == {1: "cause", **{r: "log" for r in (0, 2, 3, 4, 5, 6, 7)}}


def test_the_lowest_rank_of_each_other_host_prints_a_pointer_instead_of_the_cause():
    v = Verdict("rank 1 (x) failed: KeyError", failed=1, by=1, host="a")
    assert _roles(v, TWO_HOSTS) == {0: "log", 1: "cause", 2: "pointer", 3: "log"}


def test_a_killed_lowest_rank_leaves_the_pointer_to_the_next_rank_of_its_host():
    v = Verdict("rank 2 (x) stopped responding", failed=2, by=0, host="a")  # found by rank 0
    assert _roles(v, TWO_HOSTS) == {0: "cause", 1: "log", 3: "pointer"}


def test_an_unpublished_verdict_is_printed_by_the_lowest_surviving_rank_of_each_host():
    v = Verdict("the store host (rank 0, host a) stopped responding", failed=0)  # the store is gone
    assert _roles(v, TWO_HOSTS) == {1: "cause", 2: "cause", 3: "log"}
    assert _roles(v, {0: "a", 1: "a", 2: "a", 3: "a"}) == {1: "cause", 2: "log", 3: "log"}


def test_a_rank_whose_neighbours_hosts_are_unknown_prints_rather_than_stays_silent():
    v = Verdict("rank 0 (x) failed: E", failed=0, by=0, host="a")
    assert role(v, 3, {0: "a", 3: "b"}) == "pointer"  # rank 2 on "b" not heard of: one line too many, not none


def test_the_pointer_names_rank_host_and_log_but_not_the_cause():
    v = Verdict("rank 1 (llm stage 0 dp 0) failed: KeyError: 'mb'", failed=1, by=1, host="a", log="/r/logs/rank1.log")
    line = pointer_line(v, "rank 2 (y)", " at step 7", "rank 1 (llm stage 0 dp 0)", TWO_HOSTS, "/r/logs/rank2.log")
    assert line == ("rank 2 (y): stopping at step 7: rank 1 (llm stage 0 dp 0) on host a failed; its cause is in its "
                    "output and in /r/logs/rank1.log")
    assert "KeyError" not in line
    found = Verdict("rank 1 (x) stopped responding", failed=1, by=0, host="a", log="/r/logs/rank0.log")
    assert "in the output of rank 0 on host a and in /r/logs/rank0.log" in pointer_line(
        found, "rank 2 (y)", "", "rank 1 (x)", TWO_HOSTS, None)
    assert terminal_line(v, 3, TWO_HOSTS, "full", "pointer") is None
    assert terminal_line(v, 2, TWO_HOSTS, "full", "pointer") == "pointer"


class FakeConsole:
    """A rank's log, already in the run directory."""

    def __init__(self, rank: int):
        self.log_path, self.in_run_dir, self.lines = Path(f"/run/logs/rank{rank}.log"), True, []

    def log(self, line: str) -> None:
        self.lines.append(line)


def _job(hosts: dict[int, str], console: bool = True, interval_s: float = 0.02):
    """Watchdogs of one job on one fake store, started; (watchdogs, terminal lines, exit codes) per rank."""
    store = FakeStore()
    names = {r: f"m{r}" for r in hosts}
    lines, codes = {r: [] for r in hosts}, {r: [] for r in hosts}
    dogs = {r: Watchdog(store, r, names, timeout_s=10, interval_s=interval_s, emit=lines[r].append, exit_fn=codes[r].append,
                        console=FakeConsole(r) if console else None, host=h) for r, h in hosts.items()}
    for w in dogs.values():
        w.step = 5
    starts = [threading.Thread(target=w.start) for w in dogs.values()]  # together, as after the process group forms
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    assert all(w.hosts == hosts for w in dogs.values())  # start() read them all
    return dogs, lines, codes


def _wait_for_exits(codes: dict[int, list], ranks) -> None:
    deadline = time.monotonic() + 5
    while not all(codes[r] for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_failed_ranks_cause_reaches_the_terminal_once_and_every_other_ranks_log(tmp_path):
    dogs, lines, codes = _job(dict.fromkeys(range(4), "h"))
    dogs[2].failure_dir = str(tmp_path)
    dogs[2].handle(KeyError("mb"), 0.0)
    _wait_for_exits(codes, (0, 1, 3))
    assert codes == {0: [EXIT_PEER_FAILED], 1: [EXIT_PEER_FAILED], 2: [EXIT_FAILED], 3: [EXIT_PEER_FAILED]}
    shown = [ln for r in lines for ln in lines[r]]
    assert len(shown) == 1 and shown[0].startswith("rank 2 (m2) failed at step 5: KeyError: 'mb'")  # not 4 times
    for r in (0, 1, 3):
        line = f"rank {r} (m{r}): stopping at step 5 because rank 2 (m2) failed: KeyError: 'mb'"
        assert dogs[r].console.lines == [line]
    assert dogs[2].console.lines == shown


def test_on_another_host_only_its_lowest_rank_prints_and_without_the_cause(tmp_path):
    dogs, lines, codes = _job({0: "a", 1: "a", 2: "b", 3: "b"})
    dogs[1].failure_dir = str(tmp_path)
    dogs[1].handle(KeyError("mb"), 0.0)
    _wait_for_exits(codes, (0, 2, 3))
    assert lines[0] == lines[3] == [] and len(lines[1]) == 1 and "KeyError" in lines[1][0]
    assert lines[2] == ["rank 2 (m2): stopping at step 5: rank 1 (m1) on host a failed; its cause is in its output "
                        "and in /run/logs/rank1.log"]
    assert "KeyError" in dogs[2].console.lines[0] and "KeyError" in dogs[3].console.lines[0]


def test_ranks_failing_at_once_show_one_cause_the_first_published(tmp_path):
    # Watchdog threads that look once a second: rank 2 fails before its own looks at rank 1's verdict.
    dogs, lines, codes = _job(dict.fromkeys(range(3), "h"), interval_s=1.0)
    for r in (1, 2):
        dogs[r].failure_dir = str(tmp_path)
        dogs[r].handle(ValueError(f"bad record on rank {r}"), 0.0)
    _wait_for_exits(codes, (0,))
    assert [len(lines[r]) for r in range(3)] == [0, 1, 0] and "rank 1" in lines[1][0]
    assert dogs[2].console.lines[0].startswith("rank 2 (m2) failed at step 5: ValueError: bad record on rank 2")
    assert codes[2] == [EXIT_FAILED]  # exit codes as before: its own failure


def test_before_the_run_directory_every_rank_prints_its_line_as_before(tmp_path):
    dogs, lines, codes = _job(dict.fromkeys(range(3), "h"), console=False)
    dogs[1].failure_dir = str(tmp_path)
    dogs[1].handle(KeyError("mb"), 0.0)
    _wait_for_exits(codes, (0, 2))
    assert all(len(lines[r]) == 1 and "KeyError: 'mb'" in lines[r][0] for r in range(3)), lines


def test_a_store_host_stopping_right_after_start_is_reported_by_one_rank(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # rank 0 hosts the store
    dogs, lines, codes = _job(dict.fromkeys(range(4), "h"))  # start() knows every host before any check
    for w in dogs.values():
        w.store_op_s = 0.2
        w.store = HungStore()
    _wait_for_exits(codes, range(4))
    assert [len(lines[r]) for r in range(4)] == [0, 1, 0, 0], lines  # nobody could publish: rank 1 says it
    assert "because the store host (rank 0, host " in lines[1][0]
    assert all("stopped responding" in dogs[r].console.lines[0] for r in (0, 2, 3))


def test_ranks_that_started_late_are_placed_on_their_hosts_once_every_rank_has_announced_itself():
    store = FakeStore()
    w = dog(store)
    w.announce()
    dog(store, rank=1, host="b").announce()
    w.check(now=0.0)
    assert w.hosts == {0: w.host}  # rank 2 not there yet: the map is read whole, once
    dog(store, rank=2, host="c").announce()
    w.check(now=1.0)
    assert w.hosts == {0: w.host, 1: "b", 2: "c"}

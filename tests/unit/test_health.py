"""The watchdog's verdicts on a fake store and a fake clock (no processes)."""

from __future__ import annotations

import errno
import time

import pytest
import torch.distributed as tdist

from disttrain_ds.configtools import ConfigError
from disttrain_ds.runtime.health import EXIT_FAILED, EXIT_PEER_FAILED, Watchdog, one_line, waits_for_peer


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, k, v):
        self.data[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.data[k]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data.get(k, b"") for k in keys]


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
    assert verdict and "rank 2 (generator stage 0 dp 0) stopped responding" in verdict


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
    assert other.check(now=0.0) == "rank 1 (llm stage 0 dp 0) failed: ValueError: bad batch"


def test_handle_blames_a_dead_neighbour_for_a_broken_connection():
    store, lines, codes = FakeStore(), [], []
    w = dog(store, emit=lines.append, exit_fn=codes.append, interval_s=0.01)
    store.set("fault", "rank 2 (generator stage 0 dp 0) stopped responding")
    w.handle(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. This is typically x"), 1.0)
    assert codes == [EXIT_PEER_FAILED]
    assert "because rank 2 (generator stage 0 dp 0) stopped responding" in lines[0]
    assert "seen here as: RuntimeError: Read error [127.0.0.1]:1: Connection reset by peer" in lines[0]


def test_handle_reports_a_local_bug_as_this_ranks_failure(tmp_path):
    store, lines, codes = FakeStore(), [], []
    w = dog(store, rank=1, emit=lines.append, exit_fn=codes.append)
    w.failure_dir, w.step = str(tmp_path), 7
    w.handle(KeyError("mb"), 0.0)
    assert codes == [EXIT_FAILED]
    assert lines[0].startswith("rank 1 (llm stage 0 dp 0) failed at step 7: KeyError: 'mb' (traceback: ")
    assert store.get("fault").decode().startswith("rank 1 (llm stage 0 dp 0) failed: KeyError")
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

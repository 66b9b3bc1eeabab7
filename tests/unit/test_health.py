"""The watchdog's verdicts on a fake store and a fake clock (no processes)."""

from __future__ import annotations

import pytest

from disttrain_ds.runtime.health import EXIT_FAILED, EXIT_PEER_FAILED, Watchdog, one_line


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

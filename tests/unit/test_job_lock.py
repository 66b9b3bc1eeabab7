"""One job per checkpoint (and run) directory: a second live job is refused in one line naming the
holder; a dead holder's lock (stale heartbeat, or its process gone on this host) is taken over, saying
so; a restart of the same job takes its lock back; the heartbeat keeps a live holder fresh."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from disttrain_ds.checkpoint.lock import LOCK_NAME, DirectoryInUse, DirectoryLock, Holder, gone_reason, job_identity


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _lock(tmp_path, clock, job: str = "", log=None) -> DirectoryLock:
    return DirectoryLock(tmp_path, "checkpoint.dir", 120.0, log or (lambda line: None), clock=clock, job=job)


def _foreign(tmp_path, **fields) -> None:
    """A lock written by another job (another host unless ``host`` says this one)."""
    holder = {"host": "node-7", "pid": 4242, "job": "TORCHELASTIC_RUN_ID=abc", "started": 900.0, "beat": 990.0,
              **fields}
    (tmp_path / LOCK_NAME).write_text(json.dumps(holder))


def test_a_free_directory_is_taken_and_released(tmp_path):
    lock = _lock(tmp_path, Clock()).acquire()
    held = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_second_live_job_is_refused_in_one_line_naming_the_holder(tmp_path):
    _foreign(tmp_path)
    with pytest.raises(DirectoryInUse) as err:
        _lock(tmp_path, Clock(1000.0)).acquire()
    msg = str(err.value)
    assert "in use by another job" in msg and "node-7 pid 4242" in msg and "10 s ago" in msg and "\n" not in msg
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"  # left as it was


def test_a_lock_without_heartbeat_is_taken_over_saying_so(tmp_path):
    _foreign(tmp_path, beat=800.0)
    said = []
    _lock(tmp_path, Clock(1000.0), log=said.append).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "took the lock over" in said[0] and "no heartbeat for 200 s" in said[0]


def test_a_lock_of_a_process_gone_from_this_host_is_taken_over_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _foreign(tmp_path, host=socket.gethostname(), pid=int(dead.stdout), beat=999.0)
    said = []
    _lock(tmp_path, Clock(1000.0), log=said.append).acquire()
    assert "is gone" in said[0]


def test_a_restart_of_the_same_job_takes_its_lock_back(tmp_path):
    _foreign(tmp_path, job="DISTTRAIN_JOB_ID=run-1")
    said = []
    _lock(tmp_path, Clock(1000.0), job="DISTTRAIN_JOB_ID=run-1", log=said.append).acquire()
    assert "a restart of the same job" in said[0]
    # Negative control: another job's identity is no restart.
    _foreign(tmp_path, job="DISTTRAIN_JOB_ID=run-2")
    with pytest.raises(DirectoryInUse):
        _lock(tmp_path, Clock(1000.0), job="DISTTRAIN_JOB_ID=run-1").acquire()


def test_the_heartbeat_keeps_a_live_holder_fresh(tmp_path):
    clock = Clock(1000.0)
    lock = _lock(tmp_path, clock).acquire()
    clock.now = 1100.0
    assert lock.beat()
    clock.now = 1200.0  # 100 s after the beat: still held
    with pytest.raises(DirectoryInUse):
        _lock(tmp_path, clock, job="other").acquire()
    lock.release()


def test_the_heartbeat_thread_renews_the_lock(tmp_path):
    lock = DirectoryLock(tmp_path, "checkpoint.dir", 0.2, lambda line: None).acquire().start_heartbeat(0.02)
    first = json.loads((tmp_path / LOCK_NAME).read_text())["beat"]
    deadline = time.monotonic() + 30  # a liveness bound for a loaded machine, not a timing check
    while json.loads((tmp_path / LOCK_NAME).read_text())["beat"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["beat"] > first
    lock.release()


def test_a_lock_taken_over_by_another_job_is_not_renewed_or_removed(tmp_path):
    lock = _lock(tmp_path, Clock()).acquire()
    _foreign(tmp_path)
    assert not lock.beat()
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"


def test_gone_reason_and_job_identity_are_pure():
    h = Holder("a", 1, "", 0.0, 100.0)
    assert gone_reason(h, 150.0, 60.0, "b") is None
    assert "no heartbeat" in gone_reason(h, 200.0, 60.0, "b")
    assert "gone" in gone_reason(h, 150.0, 60.0, "a", alive=lambda pid: False)
    assert job_identity({"TORCHELASTIC_RUN_ID": "x"}) == "TORCHELASTIC_RUN_ID=x"
    assert job_identity({"DISTTRAIN_JOB_ID": "y", "TORCHELASTIC_RUN_ID": "x"}) == "DISTTRAIN_JOB_ID=y"
    assert job_identity({"TORCHELASTIC_RUN_ID": "none"}) == ""

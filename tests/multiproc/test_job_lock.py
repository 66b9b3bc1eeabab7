"""A second job on a checkpoint directory another live job holds stops at start, every rank, in one
line naming the holder, before it writes or prunes anything; once the holder is gone it runs."""

from __future__ import annotations

import pytest

from disttrain_ds.checkpoint.lock import LOCK_NAME, DirectoryLock

from .conftest import launch


@pytest.mark.slow  # two jobs; the lock's rules are pinned without processes in tests/unit/test_job_lock.py
def test_a_second_job_on_a_held_checkpoint_directory_stops_at_start(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step_00000001").mkdir()  # a checkpoint of the holder's (incomplete: nothing may touch it)
    holder = DirectoryLock(ck, "checkpoint.dir", 60.0, lambda line: None, job="DISTTRAIN_JOB_ID=first").acquire()
    holder.start_heartbeat(1.0)
    args = ["layout=disaggregated", "train.steps=2", "checkpoint.every=1", f"checkpoint.dir={ck}"]
    try:
        proc = launch(tmp_path / "second", 4, args, check=False, timeout=300)
    finally:
        holder.release()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "is in use by another job" in out and f"pid {holder.me.pid}" in out and "DISTTRAIN_JOB_ID=first" in out
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001"]  # nothing written, the lock left to its holder
    # The holder gone, the same command runs and leaves no lock behind.
    launch(tmp_path / "third", 4, args)
    assert not (ck / LOCK_NAME).exists() and (ck / "step_00000002").is_dir()

"""A producer that is alive but stopped (SIGSTOP) fails the trainer's wait within the stall timeout."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import ProducerError, build_source
from disttrain_ds.data.spool import NodeShare
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))


def _stop_and_expect_failure(src, step0: int) -> None:
    victim = src._procs[0]
    os.kill(victim.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    pattern = (rf"^data.producers: producer 0 \(pid {victim.pid}, host {socket.gethostname()}\) stopped making "
               r"progress: no heartbeat for \d+ s \(stopped or hung\) while step \d+ was due$")
    with pytest.raises(ProducerError, match=pattern):
        for step in range(step0, 50):  # what it queued before stopping still arrives first
            src.global_batch(step)
    assert time.monotonic() - t0 < src.stall_timeout_s + 5
    victim.join(timeout=5)
    assert not victim.is_alive()  # killed: a stopped producer must not outlive the job


def test_stopped_producer_is_reported_instead_of_waiting_forever():
    with build_source(DataConfig(producers=1, queue_depth=2), SHAPE, 2, 0) as src:
        src.stall_timeout_s = 2.0
        src.global_batch(0)
        _stop_and_expect_failure(src, 1)


def test_stopped_producer_of_a_shared_spool_is_reported(tmp_path: Path):
    with build_source(DataConfig(producers=1, queue_depth=2), SHAPE, 2, 0) as src:
        src.stall_timeout_s = 2.0
        src.share_with(NodeShare(tmp_path / "disttrain-spool-t", 0, (0,), os.getpid()))
        src.global_batch(0)
        _stop_and_expect_failure(src, 1)
        src.release_spool()

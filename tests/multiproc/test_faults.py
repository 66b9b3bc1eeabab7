"""Faults: a killed or hung rank makes every other rank stop within 60 s, naming it.

Ranks are started directly (one process each, rank 0 hosting the rendezvous store), as a
multi-node launcher would: no local agent tears the job down for us, so what is tested is the
job's own failure detection.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import metrics_steps, start_ranks, wait_until

WORLD = 4
VICTIM = 2  # the LLM's second stage: not the store host, with neighbours on both sides
VICTIM_NAME = "rank 2 (llm stage 1 dp 0)"


def _run_fault(tmp: Path, sig: int) -> tuple[float, dict[int, tuple[int, str]]]:
    overrides = ["train.steps=100000", "parallel.heartbeat_timeout_s=10", "parallel.comm_timeout_s=300"]
    procs = start_ranks(tmp / "run", WORLD, overrides)
    try:
        wait_until(lambda: len(metrics_steps(tmp / "run")) >= 2, procs, "step 2")
        os.kill(procs[VICTIM].pid, sig)
        t0 = time.monotonic()
        results = {}
        for rank, p in enumerate(procs):
            if rank == VICTIM:
                continue
            try:
                _, err = p.communicate(timeout=max(1.0, 60 - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still running 60 s after the fault")
            results[rank] = (p.returncode, err)
        return time.monotonic() - t0, results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # also ends a SIGSTOPped process
            p.wait()


def _assert_named(results: dict[int, tuple[int, str]]) -> None:
    for rank, (code, err) in results.items():
        assert code != 0, f"rank {rank} exited 0 after a peer failed"
        lines = [ln for ln in err.splitlines() if VICTIM_NAME in ln]
        assert lines, f"rank {rank} did not name {VICTIM_NAME}: {err[-2000:]}"
        assert "Traceback" not in err, err[-2000:]


def test_killed_rank_stops_every_other_rank_within_60s_naming_it(tmp_path):
    elapsed, results = _run_fault(tmp_path, signal.SIGKILL)
    assert elapsed < 60
    _assert_named(results)


@pytest.mark.slow
def test_hung_rank_stops_every_other_rank_within_60s_naming_it(tmp_path):
    elapsed, results = _run_fault(tmp_path, signal.SIGSTOP)
    assert elapsed < 60
    _assert_named(results)
    assert any("stopped responding" in err for _, err in results.values())

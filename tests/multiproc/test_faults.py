"""Faults: a killed or hung rank, a stopped data producer or a stopped store host makes every
other rank stop within 60 s, naming it.

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

import psutil
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


def _producer_pids(pid: int) -> list[int]:
    """Data producer processes of a rank: the children of its multiprocessing fork server."""
    return [c.pid for child in psutil.Process(pid).children() if "forkserver" in " ".join(child.cmdline())
            for c in child.children()]


def _wait_all(procs: list[subprocess.Popen], ranks: list[int], bound: float) -> tuple[float, dict[int, tuple[int, str]]]:
    t0, results = time.monotonic(), {}
    for rank in ranks:
        try:
            _, err = procs[rank].communicate(timeout=max(1.0, bound - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still running {bound:.0f} s after the fault")
        results[rank] = (procs[rank].returncode, err)
    return time.monotonic() - t0, results


def _assert_every_line(results: dict[int, tuple[int, str]], text: str) -> None:
    for rank, (code, err) in results.items():
        assert code != 0, f"rank {rank} exited 0 after a fault"
        assert any(text in ln for ln in err.splitlines()), f"rank {rank} did not say {text!r}: {err[-2000:]}"
        assert "Traceback" not in err, err[-2000:]


def test_stopped_data_producer_stops_every_rank_naming_it(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    overrides = ["train.steps=100000", "parallel.heartbeat_timeout_s=10", "parallel.comm_timeout_s=300",
                 "data.producers=1", "data.queue_depth=2", f"data.spool_dir={spool}"]
    procs = start_ranks(tmp_path / "run", WORLD, overrides)
    pids: list[int] = []
    try:
        wait_until(lambda: len(metrics_steps(tmp_path / "run")) >= 1, procs, "step 1")
        pids = _producer_pids(procs[0].pid)  # rank 0 is the host's data leader
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGSTOP)
        elapsed, results = _wait_all(procs, list(range(WORLD)), 60)
        assert elapsed < 60
        _assert_every_line(results, f"producer 0 (pid {pids[0]}, host ")
        assert "stopped making progress" in results[1][1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_stopped_store_host_stops_every_other_rank_naming_it(tmp_path):
    overrides = ["train.steps=100000", "parallel.heartbeat_timeout_s=10", "parallel.comm_timeout_s=300"]
    procs = start_ranks(tmp_path / "run", WORLD, overrides)
    try:
        wait_until(lambda: len(metrics_steps(tmp_path / "run")) >= 1, procs, "step 1")
        os.kill(procs[0].pid, signal.SIGSTOP)
        elapsed, results = _wait_all(procs, list(range(1, WORLD)), 30)
        assert elapsed < 10 + 15
        _assert_every_line(results, "because the store host (rank 0, host 127.0.0.1) stopped responding")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # also ends the stopped rank 0
            p.wait()

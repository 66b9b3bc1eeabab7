"""Faults: a killed or hung rank, a stopped data producer or a stopped store host makes every
other rank stop within 60 s, naming it: the cause reaches the terminal once (one host: one line),
and every other rank's line with the cause is in its ``<run dir>/logs/rank<N>.log``.

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

from .conftest import launch, metrics_steps, start_ranks, wait_until

WORLD = 4
VICTIM = 2  # the LLM's second stage: not the store host, with neighbours on both sides
VICTIM_NAME = "rank 2 (llm stage 1 dp 0)"


Results = dict[int, tuple[int, str]]
"""Per rank: exit code, and what it printed on the terminal (standard output and error)."""


def _finish(procs: list[subprocess.Popen], stopped: list[int]) -> str:
    """Kill what still runs (also ends a SIGSTOPped process); the terminal output of ``stopped``."""
    out = []
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        if rank in stopped and p.stdout is not None and not p.stdout.closed:
            out += p.communicate()
        p.wait()
    return "".join(out)


def _run_fault(tmp: Path, sig: int) -> tuple[float, Results, str]:
    """(seconds until the others exited, their results, the victim's terminal output)."""
    overrides = ["train.steps=100000", "parallel.heartbeat_timeout_s=10", "parallel.comm_timeout_s=300"]
    procs = start_ranks(tmp / "run", WORLD, overrides)
    try:
        wait_until(lambda: len(metrics_steps(tmp / "run")) >= 2, procs, "step 2")
        os.kill(procs[VICTIM].pid, sig)
        elapsed, results = _wait_all(procs, [r for r in range(WORLD) if r != VICTIM], 60)
        return elapsed, results, _finish(procs, [VICTIM])
    finally:
        _finish(procs, [])


def _assert_cause_once(results: Results, run: Path, cause: str, elsewhere: str = "") -> str:
    """``cause`` in exactly one terminal line of the whole job (``elsewhere``: the terminal output
    of ranks not in ``results``), and in the run-dir log of every rank in ``results``; that line."""
    for rank, (code, out) in results.items():
        assert code != 0, f"rank {rank} exited 0 after a fault"
        assert "Traceback" not in out, out[-2000:]
    terminal = "\n".join([out for _, out in results.values()] + [elsewhere])
    shown = [ln for ln in terminal.splitlines() if cause in ln]
    assert len(shown) == 1, f"{cause!r} on the terminal {len(shown)} times, not once: {shown}"  # was once per rank
    for rank in results:
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert cause in log, f"rank {rank}'s log does not name {cause!r}: {log[-2000:]}"
    return shown[0]


def test_killed_rank_stops_every_other_rank_within_60s_naming_it_once(tmp_path):
    elapsed, results, victim = _run_fault(tmp_path, signal.SIGKILL)
    assert elapsed < 60
    line = _assert_cause_once(results, tmp_path / "run", VICTIM_NAME, victim)
    assert "stopping at step " in line and "stopped responding" in line


@pytest.mark.slow
def test_hung_rank_stops_every_other_rank_within_60s_naming_it_once(tmp_path):
    elapsed, results, victim = _run_fault(tmp_path, signal.SIGSTOP)
    assert elapsed < 60
    line = _assert_cause_once(results, tmp_path / "run", VICTIM_NAME, victim)
    assert "stopped responding" in line


def _producer_pids(pid: int) -> list[int]:
    """Data producer processes of a rank: the children of its multiprocessing fork server."""
    return [c.pid for child in psutil.Process(pid).children() if "forkserver" in " ".join(child.cmdline())
            for c in child.children()]


def _wait_all(procs: list[subprocess.Popen], ranks: list[int], bound: float) -> tuple[float, Results]:
    t0, results = time.monotonic(), {}
    for rank in ranks:
        try:
            out, err = procs[rank].communicate(timeout=max(1.0, bound - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still running {bound:.0f} s after the fault")
        results[rank] = (procs[rank].returncode, out + err)
    return time.monotonic() - t0, results


@pytest.mark.slow
def test_stopped_data_producer_stops_every_rank_naming_it_once(tmp_path):
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
        line = _assert_cause_once(results, tmp_path / "run", f"producer 0 (pid {pids[0]}, host ")
        assert "stopped making progress" in line
    finally:
        _finish(procs, [])
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_stopped_store_host_stops_every_other_rank_naming_it_once(tmp_path):
    overrides = ["train.steps=100000", "parallel.heartbeat_timeout_s=10", "parallel.comm_timeout_s=300"]
    procs = start_ranks(tmp_path / "run", WORLD, overrides)
    try:
        wait_until(lambda: len(metrics_steps(tmp_path / "run")) >= 1, procs, "step 1")
        os.kill(procs[0].pid, signal.SIGSTOP)
        elapsed, results = _wait_all(procs, list(range(1, WORLD)), 30)
        assert elapsed < 10 + 15
        line = _assert_cause_once(results, tmp_path / "run", "because the store host (rank 0, host 127.0.0.1) stopped "
                                  "responding", _finish(procs, [0]))
        assert line.startswith("rank 1 ")  # nobody can publish it: the lowest rank besides the store host says it
    finally:
        _finish(procs, [])


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_in_one_line_and_resume_auto_continues_once_there_is_room(tmp_path):
    """Rank 2's share of step 2's checkpoint hits ENOSPC: every rank stops (none waits in DeepSpeed's
    barrier), the line names the directory, the error, the free space and step 1's intact checkpoint;
    the half-written step is gone; with room again, ``resume: auto`` trains on as a straight run."""
    ckpt = tmp_path / "ckpt"
    common = ["layout=disaggregated", "train.steps=3", "checkpoint.every=1", "checkpoint.keep=0", f"checkpoint.dir={ckpt}"]
    failed = launch(tmp_path / "full", 4, common, fault="disk_full_rank2_step2", check=False, timeout=300)
    assert failed.returncode != 0
    said = [line for line in (failed.stdout + failed.stderr).splitlines() if "could not write step_00000002" in line]
    assert said and "No space left on device" in said[0] and "free there" in said[0], said
    assert f"the newest intact checkpoint is {ckpt / 'step_00000001'}" in said[0], said
    assert (ckpt / "step_00000001" / "manifest.json").exists() and not list(ckpt.glob("step_00000002*"))
    resumed = launch(tmp_path / "resumed", 4, [*common, "train.resume=auto"], check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight, _, _ = launch(tmp_path / "straight", 4, ["layout=disaggregated", "train.steps=3"])
    # The resumed job appends to the run directory its checkpoint names (the failed job's).
    after_1 = [r["loss"] for r in metrics_steps(tmp_path / "full" / "run") if r["step"] > 1]
    assert after_1 == [r["loss"] for r in straight if r["step"] > 1] and len(after_1) == 2

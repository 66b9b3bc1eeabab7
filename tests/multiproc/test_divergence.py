"""A loss that is not finite stops every rank at the same step, each with exit code 1, and the
job says so in one line naming the step (rank 0's), with no rank blaming another.

Ranks are started directly (rank 0 hosting the store), as in ``test_faults.py``: no agent ends
the other ranks for us, so each rank's own exit code is what is checked.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from .conftest import metrics_steps, start_ranks


@pytest.mark.slow
def test_diverged_loss_stops_every_rank_with_one_line(tmp_path):
    run = tmp_path / "run"
    procs = start_ranks(run, 4, ["optim.lr=1.0e+30", "train.steps=8", "parallel.heartbeat_timeout_s=10"])
    results = []
    try:
        for p in procs:
            try:
                _, err = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                pytest.fail("a rank still runs 240 s after start")
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    everything = "\n".join(err for _, err in results)
    assert [code for code, _ in results] == [1, 1, 1, 1], everything[-3000:]
    lines = [ln for ln in everything.splitlines() if "not finite" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: loss is not finite at step "), everything[-3000:]
    assert "Traceback" not in everything and "because rank" not in everything, everything[-3000:]
    step = int(re.search(r"at step (\d+)", lines[0]).group(1))
    rows = metrics_steps(run)
    assert [r["step"] for r in rows] == list(range(1, step + 1))  # the diverged step is logged, none after it
    assert not (run / "trace").exists()  # the run stopped: no end-of-run files

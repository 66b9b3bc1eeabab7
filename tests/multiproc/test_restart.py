"""torchrun --max-restarts: a rank killed mid-run, the job restarted from its last checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import REPO, metrics_steps
from .test_resume import BASE, _torchrun


def test_torchrun_restart_after_a_killed_rank_matches_straight_run(tmp_path):
    straight = _torchrun(["train.steps=6", f"logging.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = [r["loss"] for r in metrics_steps(tmp_path / "straight")]

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--max-restarts=1",
           "tools/train.py", "--recipe", *BASE, "train.steps=6", "checkpoint.every=2",
           f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={run}", "parallel.heartbeat_timeout_s=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
           "DISTTRAIN_KILL_AT": "2:3"}  # rank 2 dies after step 3 of the first launch
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "DISTTRAIN_KILL_AT=2:3: exiting abruptly" in proc.stderr
    assert "at step 2" in proc.stdout  # resumed from the step-2 checkpoint
    rows = metrics_steps(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == expected

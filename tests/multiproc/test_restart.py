"""torchrun --max-restarts and disttrain-launch --max-restarts: a rank killed mid-run, the job
restarted from its last checkpoint."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from .conftest import REPO, metrics_steps
from .test_resume import BASE, _torchrun


@pytest.mark.slow
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``tools/launch.py`` (``disttrain-launch`` of a checkout) on a local 4-slot hostfile: the
    ``deepspeed`` launcher starts the ranks."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    cmd = [sys.executable, "tools/launch.py", "--hostfile", str(hostfile), "--master_port", str(_free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **(env_extra or {})}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_disttrain_launch_restarts_a_killed_rank_from_the_newest_checkpoint_and_matches_straight_run(tmp_path):
    straight = _launch(tmp_path, "--recipe", *BASE, "train.steps=6", f"logging.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    expected = [r["loss"] for r in metrics_steps(tmp_path / "straight")]
    assert len(expected) == 6

    # Rank 2 exits abruptly after step 3, between the checkpoints of steps 2 and 4: the restart
    # (DISTTRAIN_LAUNCH_ATTEMPT=1, so no second kill) rolls back to step 2 and trains on.
    run = tmp_path / "run"
    proc = _launch(tmp_path, "--max-restarts", "1", "--recipe", *BASE, "train.steps=6", "checkpoint.every=2",
                   f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={run}", "parallel.heartbeat_timeout_s=5",
                   "train.resume=none",  # replaced by train.resume=auto on the restart
                   env_extra={"DISTTRAIN_KILL_AT": "2:3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "restarts: up to 1 after a failure" in proc.stdout
    assert "DISTTRAIN_KILL_AT=2:3: exiting abruptly" in proc.stderr
    assert re.search(r"^restart 1/1 after exit code \d+ \(resuming from the newest checkpoint\)$", proc.stderr, re.M)
    assert proc.stderr.splitlines()[-1] == "finished after 1 restart"
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000002'} at step 2" in proc.stdout
    rows = metrics_steps(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == expected  # bit-identical to the uninterrupted run

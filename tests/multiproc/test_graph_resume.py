"""A module-graph run (tiny_vlm: modules named vision and llm) stops at a checkpoint and resumes
to the per-step losses of an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import REPO, metrics_steps, nccl_rules


def _run(overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "tools/train.py",
           "--recipe", "tiny_vlm", "layout=disaggregated", "logging.wandb=disabled", "parallel.comm_timeout_s=120",
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **nccl_rules()}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_graph_run_resumes_from_its_checkpoint_to_the_straight_runs_losses(tmp_path):
    straight = _run(["train.steps=4", f"logging.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2", f"logging.dir={tmp_path / 'run'}"]
    first = _run(["train.steps=2", *ckpt])
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step_00000002").iterdir() if p.is_dir()) == ["llm", "rng", "vision"]
    second = _run(["train.steps=4", *ckpt])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 2" in second.stdout
    assert [r["loss"] for r in metrics_steps(tmp_path / "run")] == [r["loss"] for r in metrics_steps(tmp_path / "straight")]

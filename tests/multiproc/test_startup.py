"""Start-up of a torchrun job: one screen from rank 0 (rank map, data, recipe, steps); DeepSpeed's
and wandb's chatter in ``<run dir>/logs/rank<N>.log``; a recipe error once, in torchrun's summary too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, nccl_rules

LIBRARY_LINES = ("SEED_LAYERS=", "stage=0 layers=", "real_accelerator", "Setting accelerator", "wandb: Tracking",
                 "wandb: Run history", "W&B syncing")


def _torchrun(overrides: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "tools/train.py",
           "--recipe", "recipes/tiny_cpu.yaml", "layout=disaggregated", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "WANDB_MODE")}
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **nccl_rules()})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.slow  # the default tier keeps the one-line recipe error under torchrun
def test_startup_shows_our_lines_and_sends_library_output_to_the_run_directory(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = _torchrun(["train.steps=2", f"logging.dir={run_dir}", "parallel.comm_timeout_s=120"])
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-4000:]
    for line in LIBRARY_LINES:
        assert line not in terminal, terminal
    lines = proc.stdout.splitlines()
    assert lines[0] == "layout disaggregated: 4 ranks, 4 pipeline stages"
    for prefix in ("recipe recipes/tiny_cpu.yaml", "data: synthetic", "step    1", "step    2", "metrics: "):
        assert sum(line.startswith(prefix) for line in lines) == 1, (prefix, proc.stdout)
    assert sum(line.startswith("wandb:") for line in lines) == 1  # one line saying where its run is
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"rank{r}.log" for r in range(4)]
    rank0 = (logs / "rank0.log").read_text()
    assert "SEED_LAYERS=" in rank0 and "stage=0 layers=" in rank0


def test_recipe_error_under_torchrun_is_said_once_and_named_in_the_summary(tmp_path: Path):
    proc = _torchrun(["train.steps=0", f"logging.dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "'train.steps' must be >= 1" in line]
    assert errors[0].startswith("error: ") and len(errors) == 2, proc.stderr[-3000:]
    assert errors[1].strip().startswith("traceback : error: ")  # torchrun's Root Cause block

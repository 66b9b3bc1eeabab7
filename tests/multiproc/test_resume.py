"""Resume equals uninterrupted: 6 steps straight vs 3 steps, a kill, and 3 resumed steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO, metrics_steps, start_ranks, wait_until

BASE = ["recipes/tiny_cpu.yaml", "layout=disaggregated", "logging.wandb=disabled", "parallel.comm_timeout_s=120"]


def _torchrun(overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "tools/train.py",
           "--recipe", *BASE, *overrides]
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_killed_and_resumed_run_matches_uninterrupted_run_bit_for_bit(tmp_path):
    straight = _torchrun(["train.steps=6", f"logging.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = [r["loss"] for r in metrics_steps(tmp_path / "straight")]
    assert len(expected) == 6

    # A long run with node-shared data producers, killed (every rank at once, SIGKILL) once its
    # step-3 checkpoint is complete: its batch spool is left behind.
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    step3 = ckpt / "step_00000003"
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    data = ["data.producers=1", f"data.spool_dir={spool_dir}"]
    procs = start_ranks(run, 4, ["train.steps=100000", "checkpoint.every=3", "checkpoint.keep=0", f"checkpoint.dir={ckpt}", *data])
    try:
        wait_until(lambda: (step3 / "manifest.json").exists(), procs, "the step-3 checkpoint")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    manifest = json.loads((step3 / "manifest.json").read_text())
    assert manifest["step"] == 3 and any(f.startswith("llm/") for f in manifest["files"])
    before = metrics_steps(run)
    assert [r["step"] for r in before][:3] == [1, 2, 3]

    # Resume that checkpoint up to step 6 (new checkpoints elsewhere: later ones exist in ckpt).
    assert len(list(spool_dir.iterdir())) == 1
    resumed = _torchrun(["train.steps=6", f"train.resume={step3}", "checkpoint.every=3", f"checkpoint.dir={tmp_path / 'ckpt2'}", *data])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {step3} at step 3" in resumed.stdout
    rows = metrics_steps(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # appended, no step twice
    assert [r["loss"] for r in rows] == expected  # bit-identical, not merely close
    rolled = run / "metrics.rolled_back.jsonl"
    assert len(before) == 3 or [json.loads(x)["step"] for x in rolled.read_text().splitlines()] == [r["step"] for r in before[3:]]
    assert (tmp_path / "ckpt2" / "step_00000006" / "manifest.json").exists()
    assert list(spool_dir.iterdir()) == []  # the killed run's spool removed, and the resumed run's own


@pytest.mark.slow
def test_resume_auto_refuses_a_checkpoint_of_a_different_model_naming_every_field(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _torchrun(["train.steps=1", "checkpoint.every=1", f"checkpoint.dir={ckpt}", f"logging.dir={tmp_path / 'a'}"])
    assert first.returncode == 0, first.stderr[-3000:]
    # The layout may change (parallel.llm.pp=1: re-sharded); the model and the global batch may not.
    cmd = [sys.executable, "tools/train.py", "--recipe", *BASE, "train.steps=2", "checkpoint.every=1",
           f"checkpoint.dir={ckpt}", "parallel.llm.pp=1", "model.llm.layers=3", "train.global_batch=8"]
    # The check runs before any process group starts, so a single process shows it.
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WORLD_SIZE": "3"})
    assert out.returncode == 2
    err = out.stderr.strip()
    assert err.count("\n") == 0 and "model.llm.layers (checkpoint: 4, this run: 3)" in err, err
    assert "train.global_batch (checkpoint: 4, this run: 8)" in err and "parallel" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,layout",
    [
        (4, ["layout=monolithic"]),
        (5, ["parallel.encoder.dp=2", "parallel.llm.dp=2", "parallel.llm.pp=1", "model.encoder.frozen=true",
             "deepspeed_config=ds_configs/zero1.json"]),
        # Every TP rank saves and restores its own shards.
        (7, ["parallel.encoder.tp=2", "parallel.llm.tp=2"]),
    ],
    ids=["monolithic", "zero1_dp2_frozen_encoder", "encoder_tp2_llm_tp2"],
)
def test_resumed_run_matches_straight_run_in_other_layouts(tmp_path, nproc, layout):
    def run(extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "tools/train.py",
               "--recipe", *BASE, *layout, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(["train.steps=4", f"logging.dir={tmp_path / 'straight'}"])
    ck = ["checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}", f"logging.dir={tmp_path / 'run'}"]
    run(["train.steps=2", *ck])
    run(["train.steps=4", *ck])  # train.resume=auto
    assert [r["loss"] for r in metrics_steps(tmp_path / "run")] == [r["loss"] for r in metrics_steps(tmp_path / "straight")]

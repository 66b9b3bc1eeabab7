"""``disttrain-launch --max-restarts N --elastic PROFILE`` (and a torchrun worker's ``--elastic``): a lost node
re-planned unattended.

An 8-rank job on a hostfile of 8 slots (standing for two nodes of 4) loses the second node's 4 ranks
after step 3; the scheduler's hostfile then offers the 4 slots left. The supervisor re-plans the recipe for the 4 slots left
from the profile, relaunches on them from the step-2 checkpoint under the new layout, and the job
finishes unattended with the single-process reference's losses for every step (the same data
order: the global batch is kept). Negative control: without ``--elastic`` the restart asks for the
8 slots that are no longer there and the job stops.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from .conftest import REPO, metrics_steps
from .test_fidelity import SGD
from .test_restart import _free_port

LAYOUT = ["layout=disaggregated", "parallel.encoder.dp=2", "parallel.llm.dp=2", "parallel.generator.dp=2"]
PROFILE = {  # tiny_cpu's modules; costs in ms, illustrative: any layout of the recipe may be chosen
    "gpus": 8, "global_batch": 4, "microbatch": 1, "gpus_per_node": 8,
    "modules": {"encoder": {"layers": 4, "cost_ms": {"1": 10.0, "2": 6.0}},
                "llm": {"layers": 4, "cost_ms": {"1": 40.0, "2": 22.0}},
                "generator": {"layers": 3, "cost_ms": {"1": 12.0}}},
}


def _launch_losing_a_node(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, str]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=8\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "tools/launch.py", "--hostfile", str(hostfile), "--master_port", str(_free_port()),
           "--max-restarts", "1", *flags, "--recipe", "recipes/tiny_cpu.yaml", *LAYOUT, *SGD, "train.steps=6",
           "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={run}",
           "logging.wandb=disabled", "parallel.heartbeat_timeout_s=5", "parallel.comm_timeout_s=120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
           "DISTTRAIN_KILL_AT": "4,5,6,7:3"}  # the second node's 4 ranks, after step 3
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err, open(tmp_path / "stdout", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)

        def scheduler() -> None:  # drops host b's slots from the hostfile once it is gone
            while proc.poll() is None:
                if "exiting abruptly" in err_path.read_text():
                    hostfile.write_text("localhost slots=4\n")
                    return
                time.sleep(0.1)

        watcher = threading.Thread(target=scheduler, daemon=True)
        watcher.start()
        try:
            proc.wait(timeout=900)
        finally:
            proc.kill()
        watcher.join(5)
    done = subprocess.CompletedProcess(cmd, proc.returncode, (tmp_path / "stdout").read_text(), err_path.read_text())
    return done, str(run)


@pytest.mark.slow
def test_a_lost_node_is_replanned_for_the_slots_left_and_the_job_finishes_with_the_reference_losses(
        tmp_path, reference_run):
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    proc, run = _launch_losing_a_node(tmp_path, "--elastic", str(tmp_path / "profile.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "elastic: a restart that finds fewer than 8 slots re-plans" in proc.stdout
    event = re.search(r"^elastic: host localhost: 4 slots gone from the hostfile; 4 slots remain; re-planned for "
                      r"(\d) GPUs: encoder dp=\d tp=\d pp=\d, llm dp=\d tp=\d pp=\d, generator dp=\d tp=\d pp=\d; "
                      r"resuming from the newest checkpoint$", proc.stderr, re.M)
    assert event and int(event.group(1)) <= 4, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == "finished after 1 restart"
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000002'} at step 2" in proc.stdout
    rows = metrics_steps(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    ref_losses, _ = reference_run(["train.steps=6", *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.slow
def test_without_elastic_the_restart_asks_for_the_lost_slots_and_stops(tmp_path):
    proc, _ = _launch_losing_a_node(tmp_path)
    assert proc.returncode != 0
    assert "elastic:" not in proc.stderr
    assert len(metrics_steps(tmp_path / "run")) < 6


def _torchrun(tmp_path, nproc: int, *flags: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` of ``tools/train.py`` on ``nproc`` ranks, the recipe laid out for 8."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "tools/train.py", *flags, "--recipe", "recipes/tiny_cpu.yaml", *LAYOUT, *SGD, "train.steps=6",
           "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'run'}",
           "logging.wandb=disabled", "parallel.heartbeat_timeout_s=5", "parallel.comm_timeout_s=120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **(env_extra or {})}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_torchrun_restart_on_fewer_ranks_replans_from_the_profile_and_keeps_the_reference_losses(
        tmp_path, reference_run):
    """What torchrun's agent does after a node is lost (``--nnodes=MIN:MAX``): it starts the workers
    again on the ranks left. The 8-rank job loses its second "node" after step 3; started again on
    4 ranks with ``--elastic``, every worker re-plans the recipe for them from the profile, ranks
    the plan leaves out exit at once, and the job resumes from the step-2 checkpoint to finish with
    the reference's losses. Without ``--elastic`` the 4-rank start is refused in one line."""
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    lost = _torchrun(tmp_path, 8, env_extra={"DISTTRAIN_KILL_AT": "4,5,6,7:3"})
    assert lost.returncode != 0 and len(metrics_steps(tmp_path / "run")) == 3
    plain = _torchrun(tmp_path, 4)
    assert plain.returncode != 0 and "8 ranks" in plain.stderr, plain.stderr[-2000:]
    again = _torchrun(tmp_path, 4, "--elastic", str(tmp_path / "profile.json"))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    event = re.search(r"^elastic: the recipe lays out 8 ranks, 4 started; re-planned for (\d) GPUs?"
                      r"(, \d ranks? idle)?: encoder dp=\d tp=\d pp=\d, llm dp=\d tp=\d pp=\d, "
                      r"generator dp=\d tp=\d pp=\d; resuming from the newest checkpoint$", again.stdout, re.M)
    assert event and int(event.group(1)) <= 4, again.stdout[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000002'} at step 2" in again.stdout
    rows = metrics_steps(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    ref_losses, _ = reference_run(["train.steps=6", *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)

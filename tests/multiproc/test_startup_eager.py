"""Start-up under NCCL's eager rules, and deadlines that name the right rank.

Under the ``deepspeed`` launcher (and this project's own start-up on every launcher) the world is
bound to a device, so torch makes every process group by a world-wide ``ncclCommSplit``: all
ranks must make every group in one order. ``DISTTRAIN_NCCL_EMULATION=eager`` holds gloo jobs to
that rule (``comm/nccl_emulation.py``); the positive side is every layout test of the suite, which
runs under it (mixed TP degrees included: ``test_tensor_parallel.py``).
"""

from __future__ import annotations

import re

import pytest

from .conftest import launch

EAGER = {"DISTTRAIN_NCCL_EMULATION": "eager"}
LAZY = {"DISTTRAIN_NCCL_EMULATION": "lazy"}
# Encoder TP 1, LLM TP 2 x PP 2, generator TP 1: the mixed TP degrees of every mllm_* recipe.
MIXED_TP = ["layout=disaggregated", "parallel.llm.tp=2", "train.steps=1"]
QUICK = ["parallel.comm_timeout_s=8", "parallel.heartbeat_timeout_s=10"]


def _said(proc) -> str:
    return proc.stdout + proc.stderr


def _trained(proc) -> bool:
    return "step    1" in _said(proc)


@pytest.mark.slow  # the old start-up deadlocking; its guard is pinned in tests/unit/test_startup_groups.py
def test_member_only_groups_stop_a_mixed_tp_layout_at_startup_under_eager_rules(tmp_path):
    """Negative control: the old start-up (each module's groups made by its members only, the
    refusal lifted) stops before step 1, naming ranks that did not take part in a split."""
    proc = launch(tmp_path, 6, [*MIXED_TP, *QUICK], fault="member_only_groups", check=False, timeout=300,
                  env_extra=EAGER)
    said = _said(proc)
    assert proc.returncode != 0 and not _trained(proc), said[-3000:]
    assert "emulated NCCL start-up" in said, said[-3000:]
    assert "did not take part" in said or "made different groups" in said, said[-3000:]
    assert "Traceback" not in proc.stderr.split("error_file")[0] or "EmulatedStartupError" in said


@pytest.mark.slow
def test_member_only_groups_pass_under_lazy_rules(tmp_path):
    """...which torchrun's lazy start-up hides: the same job trains (why the eager rules exist)."""
    proc = launch(tmp_path, 6, [*MIXED_TP, "parallel.comm_timeout_s=60"], fault="member_only_groups", check=False,
                  timeout=300, env_extra=LAZY)
    assert proc.returncode == 0, _said(proc)[-3000:]


@pytest.mark.slow  # the guard itself is pinned in the default tier by tests/unit/test_startup_groups.py
def test_member_only_group_is_refused_in_one_line_on_a_device_bound_world(tmp_path):
    """With the refusal in place the same start-up stops at once, before any split times out."""
    proc = launch(tmp_path, 6, [*MIXED_TP, "parallel.comm_timeout_s=120"], fault="member_only_groups_guarded",
                  check=False, timeout=300, env_extra=EAGER)
    said = _said(proc)
    assert proc.returncode != 0 and not _trained(proc), said[-3000:]
    lines = [ln for ln in said.splitlines() if "made by its members only" in ln]
    assert lines and all("use_local_synchronization" in ln for ln in lines), said[-3000:]
    assert "did not take part" not in said  # refused before the emulated split could time out


@pytest.mark.slow
def test_aborted_communicator_is_reported_by_its_rank_and_nobody_else_is_blamed(tmp_path):
    """Rank 2 (llm stage 1) has its communicators aborted after step 1, as NCCL's watchdog does:
    it says so in one line and lives to say it; every other rank stops naming rank 2."""
    proc = launch(tmp_path, 4, ["layout=disaggregated", "train.steps=50", "parallel.comm_timeout_s=60",
                                "parallel.heartbeat_timeout_s=5"],
                  fault="abort_lanes_rank2", check=False, timeout=300)
    said = _said(proc)
    assert proc.returncode != 0, said[-3000:]
    failed = re.findall(r"rank (\d+) \([^)]*\) failed at step", said)
    assert failed and set(failed) == {"2"}, said[-3000:]  # the others stop "because rank 2 ... failed"
    assert "communicator aborted on rank 2" in said, said[-3000:]
    assert "CommTimeoutError" not in said  # nobody waited out its deadline and blamed itself


@pytest.mark.slow  # the default tier keeps the mixed-TP start-up (test_tensor_parallel.py)
def test_stalled_rank_is_blamed_by_the_ranks_that_waited_for_it(tmp_path):
    """Rank 2 stops answering (alive, heartbeat beating, main thread stuck): its neighbours' deadlines
    fire and the job stops naming rank 2, not the rank that waited."""
    proc = launch(tmp_path, 4, ["layout=disaggregated", "train.steps=50", "parallel.comm_timeout_s=8",
                                "parallel.heartbeat_timeout_s=30"],
                  fault="stall_rank2", check=False, timeout=300)
    said = _said(proc)
    assert proc.returncode != 0, said[-3000:]
    causes = [ln for ln in said.splitlines() if "because" in ln or " failed at step " in ln]
    assert causes, said[-3000:]
    assert all("rank 2 (llm stage 1 dp 0) did not answer" in ln for ln in causes), causes


@pytest.mark.slow  # the default tier's mixed-TP layout (test_tensor_parallel.py) runs under this launcher too
def test_mixed_tp_layout_under_the_deepspeed_launcher_matches_reference(tmp_path, reference_run):
    """The launcher users take: no agent (rank 0 hosts the store), every group a world-wide split."""
    from .conftest import max_param_mismatch
    from .test_fidelity import SGD, STEPS

    overrides = ["layout=disaggregated", "parallel.llm.tp=2", STEPS, *SGD]
    rows, params, _ = launch(tmp_path, 6, overrides, launcher="deepspeed")
    ref_losses, ref_params = reference_run([STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"

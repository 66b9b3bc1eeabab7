"""SIGTERM (preemption) saves a checkpoint at the next step boundary; resuming it equals a straight run."""

from __future__ import annotations

import signal

import pytest

from disttrain_ds.runtime.preempt import EXIT_PREEMPTED

from .conftest import metrics_steps, start_ranks, wait_until
from .test_resume import _torchrun

STEPS = 8


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_resume_matches_straight_run(tmp_path):
    straight = _torchrun([f"train.steps={STEPS}", f"logging.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = [r["loss"] for r in metrics_steps(tmp_path / "straight")]
    assert len(expected) == STEPS

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    ck = [f"train.steps={STEPS}", "checkpoint.every=1000", f"checkpoint.dir={ckpt}"]
    procs = start_ranks(run, 4, ck)
    outs = _sigterm_after(run, procs, 2, procs)  # as a scheduler does: every rank at once
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_PREEMPTED] * 4, (codes, [e[-2000:] for _, e in outs])
    saved = sorted(ckpt.glob("step_*/manifest.json"))
    assert len(saved) == 1, saved
    step = int(saved[0].parent.name.split("_")[1])
    assert 2 <= step < STEPS
    line = f"preempted: checkpoint {saved[0].parent} saved at step {step}; relaunch with train.resume=auto to continue"
    assert line in outs[0][0], outs[0][0][-2000:]
    assert [r["step"] for r in metrics_steps(run)] == list(range(1, step + 1))

    procs = start_ranks(run, 4, ck)  # train.resume=auto (the default)
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-2000:] for _, e in outs]
    assert f"at step {step}" in outs[0][0]
    rows = metrics_steps(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == expected  # bit-identical


@pytest.mark.slow
def test_sigterm_without_checkpoints_stops_cleanly(tmp_path):
    run = tmp_path / "run"
    procs = start_ranks(run, 4, ["train.steps=100000"])
    outs = _sigterm_after(run, procs, 1, procs[2:3])  # one rank only: the others learn it at the step boundary
    assert [p.returncode for p in procs] == [EXIT_PREEMPTED] * 4, [e[-2000:] for _, e in outs]
    assert "no checkpoint written (checkpoint.every=0)" in outs[0][0]


def _sigterm_after(run, procs, step: int, targets) -> list[tuple[str, str]]:
    """SIGTERM ``targets`` once ``step`` is in the metrics; every rank's (stdout, stderr)."""
    try:
        wait_until(lambda: len(metrics_steps(run)) >= step, procs, f"step {step}")
        for p in targets:
            p.send_signal(signal.SIGTERM)
        return [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

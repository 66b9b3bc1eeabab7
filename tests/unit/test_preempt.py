"""SIGTERM handling: the flag, the grace period, and the step record's agreement column."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.preempt import EXIT_PREEMPTED, Preemption


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_sigterm_sets_the_flag_and_does_not_kill():
    p = Preemption(grace_s=0).install()
    try:
        assert not p.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait(lambda: p.requested)
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not p._handler


def test_grace_period_expires_unless_handled():
    expired: list[float] = []
    p = Preemption(grace_s=0.2, on_expire=expired.append)
    p.note()
    assert _wait(lambda: expired == [0.2])

    expired.clear()
    q = Preemption(grace_s=0.3, on_expire=expired.append)
    q.note()
    q.handled()
    time.sleep(0.5)
    assert expired == []


def test_first_signal_counts():
    p = Preemption(grace_s=0)
    p.note(now=5.0)
    p.note(now=9.0)
    assert p.requested_at == 5.0


def test_exit_code_is_128_plus_sigterm():
    assert EXIT_PREEMPTED == 128 + signal.SIGTERM


def test_grace_must_not_be_negative():
    with pytest.raises(ConfigError, match="checkpoint.sigterm_grace_s"):
        load_recipe("recipes/tiny_cpu.yaml", ["checkpoint.sigterm_grace_s=-1"])
    assert load_recipe("recipes/tiny_cpu.yaml", []).checkpoint.sigterm_grace_s == 120


def test_step_record_says_whether_any_rank_was_signalled(monkeypatch):
    from disttrain_ds.runtime import step_record as d

    flags = [0.0, 1.0, 0.0]

    def fake_all_gather(rows, mine, group=None):  # noqa: ARG001
        for i, r in enumerate(rows):
            r.copy_(mine)
            r[0], r[8] = i, flags[i]  # one rank per module

    monkeypatch.setattr(d.tdist, "all_gather", fake_all_gather)

    ctx = SimpleNamespace(topo=SimpleNamespace(world_size=3), grid=SimpleNamespace(name="llm"),
                          place=SimpleNamespace(last_of_engine=True), tp_index=0, meta_group=None)
    stats = {"own_loss": 1.0, "compute_s": 0.1, "comm_wait_s": 0.0, "data_wait_s": 0.0}
    rec = d.gather_step_record(ctx, stats, 0.2, 1, 1.0, preempt=False)
    assert rec["preempt"] is True
    flags[1] = 0.0
    assert d.gather_step_record(ctx, stats, 0.2, 1, 1.0)["preempt"] is False

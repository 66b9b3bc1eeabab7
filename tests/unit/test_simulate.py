"""1F1B simulator: stage orders, dependencies, closed forms and the paper's example."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from disttrain_ds.planner.simulate import (
    makespan_1f1b, makespan_batch, simulate_1f1b, stage_order)

# Heterogeneous example: 4 stages, 6 microbatches, each microbatch as slow on every stage.
PAPER_FWD = 1000 * np.array([1, 0.5, 2, 0.7, 1.5, 0.6])


def _paper_costs() -> tuple[np.ndarray, np.ndarray]:
    fwd = np.repeat(PAPER_FWD[:, None], 4, axis=1)
    return fwd, 2 * fwd


def test_stage_order_is_warmup_then_1f1b_then_cooldown():
    assert stage_order(5, 3, 0) == [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (1, 1), (0, 4),
                                    (1, 2), (1, 3), (1, 4)]
    assert stage_order(5, 3, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3),
                                    (1, 3), (0, 4), (1, 4)]
    # fewer microbatches than stages: warm-up is capped at m
    assert stage_order(2, 4, 0) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("m,p,f,b", [(6, 4, 1.0, 2.0), (1, 5, 3.0, 1.0), (12, 3, 0.5, 1.5),
                                     (3, 7, 2.0, 2.0)])
def test_uniform_costs_give_closed_form(m, p, f, b):
    fwd, bwd = np.full((m, p), f), np.full((m, p), b)
    assert makespan_1f1b(fwd, bwd) == pytest.approx((m + p - 1) * (f + b))
    assert simulate_1f1b(fwd, bwd).makespan == pytest.approx((m + p - 1) * (f + b))


def test_paper_heterogeneous_example_input_order():
    fwd, bwd = _paper_costs()
    assert simulate_1f1b(fwd, bwd).makespan == pytest.approx(36_200)


def test_paper_heterogeneous_example_best_order_by_brute_force():
    fwd, bwd = _paper_costs()
    spans = [makespan_1f1b(fwd[list(p)], bwd[list(p)]) for p in itertools.permutations(range(6))]
    assert len(spans) == 720
    assert min(spans) == pytest.approx(30_900)


def test_events_respect_dependencies_and_stage_exclusivity():
    rng = np.random.default_rng(3)
    fwd = rng.uniform(0.5, 2, (7, 4))
    comm = rng.uniform(0, 0.3, 3)
    res = simulate_1f1b(fwd, 2 * fwd, comm)
    ev = {(e.stage, e.kind, e.microbatch): e for e in res.events}
    assert len(ev) == 2 * 7 * 4
    for (s, kind, i), e in ev.items():
        cost = fwd[i, s] * (1 if kind == "fwd" else 2)
        assert e.end - e.start == pytest.approx(cost)
        if kind == "fwd" and s > 0:
            assert e.start >= ev[(s - 1, "fwd", i)].end + comm[s - 1] - 1e-9
        if kind == "bwd" and s < 3:
            assert e.start >= ev[(s + 1, "bwd", i)].end + comm[s] - 1e-9
        if kind == "bwd" and s == 3:
            assert e.start >= ev[(s, "fwd", i)].end - 1e-9
    for s in range(4):  # ops of a stage never overlap and follow the 1F1B order
        ops = sorted((e for e in res.events if e.stage == s), key=lambda e: e.start)
        assert [(0 if e.kind == "fwd" else 1, e.microbatch) for e in ops] == stage_order(7, 4, s)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(ops, ops[1:]))
    assert res.makespan == pytest.approx(max(e.end for e in res.events))


def test_communication_delays_every_boundary_crossing():
    m, p, c = 1, 3, 0.25
    fwd, bwd = np.ones((m, p)), np.ones((m, p))
    # one microbatch: 3 forwards + 3 backwards in series, 4 boundary crossings
    assert makespan_1f1b(fwd, bwd, c) == pytest.approx(6 + 4 * c)
    per_mb = np.array([[0.1, 0.2]])
    assert makespan_1f1b(fwd, bwd, per_mb) == pytest.approx(6 + 2 * (0.1 + 0.2))


def test_makespan_batch_matches_single_simulation_with_comm():
    rng = np.random.default_rng(0)
    fwd = rng.lognormal(0, 0.5, (9, 5))
    bwd = 2 * fwd
    comm = rng.uniform(0, 0.2, (9, 4))
    orders = np.array([rng.permutation(9) for _ in range(20)])
    batch = makespan_batch(fwd, bwd, orders, comm)
    for o, span in zip(orders, batch):
        assert span == pytest.approx(makespan_1f1b(fwd[o], bwd[o], comm[o]))


def test_bubble_fraction_zero_for_single_stage_and_positive_for_pipeline():
    assert simulate_1f1b([[1.0], [2.0]], [[1.0], [1.0]]).bubble_fraction() == pytest.approx(0.0)
    res = simulate_1f1b(np.ones((4, 4)), np.ones((4, 4)))
    assert res.bubble_fraction() == pytest.approx(1 - 8 / (7 * 2))


def test_rejects_mismatched_shapes_and_negative_costs():
    with pytest.raises(ValueError, match="bwd"):
        simulate_1f1b(np.ones((3, 2)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="fwd"):
        simulate_1f1b(-np.ones((3, 2)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="comm"):
        simulate_1f1b(np.ones((3, 2)), np.ones((3, 2)), comm=[1.0, 2.0, 3.0])


def test_240_microbatches_10_stages_is_fast():
    rng = np.random.default_rng(1)
    fwd = rng.lognormal(0, 0.5, (240, 10))
    makespan_1f1b(fwd, 2 * fwd)  # builds the cached dependency plan
    t = time.perf_counter()
    for _ in range(5):
        makespan_1f1b(fwd, 2 * fwd)
    assert (time.perf_counter() - t) / 5 < 0.05  # ~3 ms typical; generous for loaded CI

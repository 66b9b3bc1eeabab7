"""1F1B simulator: stage orders, dependencies, closed forms and the paper's example."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from disttrain_ds.graph import ModuleGraph
from disttrain_ds.schedule.simulate import (
    chain_preds,
    dag_edges,
    graph_stages,
    is_chain,
    makespan_1f1b,
    makespan_batch,
    makespan_dag,
    simulate_1f1b,
    simulate_dag,
    stage_order,
)

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


def test_240_microbatches_10_stages_build_their_dependency_plan_once():
    """The schedule's dependency plan is built once per shape and reused: the work a repeated
    makespan does is the array sweep alone (its time: bench/bench_reorder.py)."""
    from disttrain_ds.schedule import simulate

    rng = np.random.default_rng(1)
    fwd = rng.lognormal(0, 0.5, (240, 10))
    first = makespan_1f1b(fwd, 2 * fwd)
    before = simulate._plan.cache_info()
    again = [makespan_1f1b(fwd * k, 2 * fwd * k) for k in (1.0, 2.0, 3.0)]
    after = simulate._plan.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 3
    assert again == pytest.approx([first, 2 * first, 3 * first])


# --------------------------------------------------------------------------- module graphs

STAR = ModuleGraph.from_roles({"a": "encoder", "b": "encoder", "llm": "llm", "x": "generator",
                               "y": "generator"})


def test_graph_stages_number_modules_in_data_flow_order_and_link_the_star():
    ranges, preds = graph_stages(STAR, {"a": 1, "b": 2, "llm": 2, "x": 2, "y": 1})
    assert {n: list(r) for n, r in ranges.items()} == {"a": [0], "b": [1, 2], "llm": [3, 4],
                                                        "x": [5, 6], "y": [7]}
    assert preds == ((), (), (1,), (0, 2), (3,), (4,), (5,), (4,))
    assert dag_edges(preds) == ((1, 2), (0, 3), (2, 3), (3, 4), (4, 5), (5, 6), (4, 7))
    _, classic = graph_stages(ModuleGraph.default(), {"encoder": 2, "llm": 3, "generator": 1})
    assert classic == chain_preds(6) and is_chain(classic) and not is_chain(preds)


@pytest.mark.parametrize("seed", range(8))
def test_dag_simulation_of_a_chain_is_the_chain_simulation(seed):
    rng = np.random.default_rng(seed)
    m, p = int(rng.integers(1, 9)), int(rng.integers(1, 6))
    fwd = rng.uniform(0.1, 3, (m, p))
    bwd = rng.uniform(0.1, 3, (m, p))
    comm = rng.uniform(0, 0.5, p - 1)
    chain = simulate_1f1b(fwd, bwd, comm)
    dag = simulate_dag(fwd, bwd, chain_preds(p), comm)
    assert dag.events == chain.events and dag.makespan == chain.makespan
    assert makespan_dag(fwd, bwd, chain_preds(p), comm) == makespan_1f1b(fwd, bwd, comm)


@pytest.mark.parametrize("seed", range(6))
def test_dag_events_respect_every_edge_and_stage_exclusivity(seed):
    rng = np.random.default_rng(seed)
    pp = {n: int(rng.integers(1, 4)) for n in STAR.names}
    _, preds = graph_stages(STAR, pp)
    p, m = len(preds), int(rng.integers(1, 8))
    fwd = rng.uniform(0.2, 2, (m, p))
    comm = rng.uniform(0, 0.3, len(dag_edges(preds)))
    res = simulate_dag(fwd, 2 * fwd, preds, comm)
    ev = {(e.stage, e.kind, e.microbatch): e for e in res.events}
    assert len(ev) == 2 * m * p
    for k, (u, s) in enumerate(dag_edges(preds)):
        for i in range(m):
            assert ev[(s, "fwd", i)].start >= ev[(u, "fwd", i)].end + comm[k] - 1e-9
            assert ev[(u, "bwd", i)].start >= ev[(s, "bwd", i)].end + comm[k] - 1e-9
    for s in range(p):
        ops = sorted((e for e in res.events if e.stage == s), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(ops, ops[1:]))
        assert sorted(e.microbatch for e in ops if e.kind == "fwd") == list(range(m))


def test_parallel_encoders_run_concurrently_before_the_llm():
    # Stages: a | b | llm | x; a and b both feed the LLM.
    _, preds = graph_stages(ModuleGraph.from_roles({"a": "encoder", "b": "encoder",
                                                    "llm": "llm", "x": "generator"}),
                            {"a": 1, "b": 1, "llm": 1, "x": 1})
    fwd = np.array([[1.0, 1.0, 2.0, 3.0]] * 5)
    parallel = makespan_dag(fwd, 2 * fwd, preds)
    one = makespan_1f1b(fwd[:, 1:], 2 * fwd[:, 1:])  # the same pipeline with one encoder
    assert parallel == one
    fwd[:, 0] = 1.5  # a slower twin sets the pace of its branch, nothing more
    assert one < makespan_dag(fwd, 2 * fwd, preds) < makespan_1f1b(fwd, 2 * fwd)
    assert makespan_dag(fwd, 2 * fwd, preds) == pytest.approx(
        makespan_1f1b(fwd[:, [0, 2, 3]], 2 * fwd[:, [0, 2, 3]]))


def test_uniform_dag_with_the_slowest_stage_last_takes_critical_path_plus_steady_state():
    pp = {"a": 2, "b": 1, "llm": 2, "x": 1, "y": 1}
    w = {"a": 4.0, "b": 3.0, "llm": 8.0, "x": 2.0, "y": 12.0}
    _, preds = graph_stages(STAR, pp)
    stages = np.concatenate([np.full(pp[n], w[n] / pp[n]) for n in STAR.names])
    k = 7
    fwd = np.tile(stages / 3, (k, 1))
    span = makespan_dag(fwd, 2 * fwd, preds)
    assert span == pytest.approx(STAR.critical_path(w) + stages.max() * (k - 1))


def test_dag_rejects_preds_that_are_not_topological_or_mis_sized():
    with pytest.raises(ValueError, match="preds"):
        simulate_dag(np.ones((2, 2)), np.ones((2, 2)), ((1,), ()))
    with pytest.raises(ValueError, match="preds"):
        makespan_dag(np.ones((2, 3)), np.ones((2, 3)), chain_preds(2))
    with pytest.raises(ValueError, match="comm"):
        makespan_dag(np.ones((2, 2)), np.ones((2, 2)), chain_preds(2), comm=-1.0)

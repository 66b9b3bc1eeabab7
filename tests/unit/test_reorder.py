"""Data reordering: equal-count DP balancing and 1F1B microbatch ordering."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from disttrain_ds.reorder.intra import (
    apply_order,
    balanced_differencing,
    build_microbatches,
    intra_microbatch_reorder,
    lpt_equal_count,
)
from disttrain_ds.reorder.microbatch_order import inter_microbatch_reorder, paper_inter_order
from disttrain_ds.schedule.simulate import makespan_1f1b, makespan_batch


def _max_load(costs, groups) -> float:
    c = np.asarray(costs, dtype=float)
    return max(float(c[g].sum()) for g in groups)


def _assert_equal_count_partition(groups, n, k):
    assert len(groups) == k
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert {len(g) for g in groups} == {n // k}


def _brute_force_intra(costs, k) -> float:
    """Optimal max load over equal-count partitions (small n only)."""
    c = np.asarray(costs, dtype=float)
    n, cap = len(c), len(c) // k
    best = np.inf
    for labels in itertools.product(range(k), repeat=n):
        if labels[0] != 0 or any(labels.count(r) != cap for r in range(k)):
            continue
        best = min(best, max(c[[i for i in range(n) if labels[i] == r]].sum() for r in range(k)))
    return float(best)


# ------------------------------------------------------------------ intra-microbatch


def test_intra_reorder_beats_lpt_on_adversarial_case():
    costs = [10, 14, 17, 2, 18, 11]  # equal-count LPT: {18,11,10}=39 vs {17,14,2}=33
    assert _max_load(costs, lpt_equal_count(costs, 2)) == 39
    ours = intra_microbatch_reorder(costs, 2, exact_max=0)  # heuristics alone
    assert _max_load(costs, ours) == _brute_force_intra(costs, 2) == 37


def test_intra_reorder_is_optimal_on_small_cases_with_exact_search():
    rng = np.random.default_rng(11)
    for _ in range(25):
        k = int(rng.integers(2, 4))
        n = k * int(rng.integers(2, 4))
        costs = rng.integers(1, 30, n).astype(float)
        groups = intra_microbatch_reorder(costs, k)
        _assert_equal_count_partition(groups, n, k)
        assert _max_load(costs, groups) == pytest.approx(_brute_force_intra(costs, k))


def test_intra_reorder_property_valid_and_no_worse_than_lpt():
    rng = np.random.default_rng(2024)
    for trial in range(120):
        k = int(rng.integers(1, 9))
        n = k * int(rng.integers(1, 12))
        dist = trial % 3
        costs = (rng.lognormal(0, 1.2, n) if dist == 0 else rng.integers(0, 50, n).astype(float)
                 if dist == 1 else rng.pareto(1.5, n))
        groups = intra_microbatch_reorder(costs, k)
        _assert_equal_count_partition(groups, n, k)
        ours = _max_load(costs, groups)
        assert ours <= _max_load(costs, lpt_equal_count(costs, k)) + 1e-9
        assert ours <= _max_load(costs, balanced_differencing(costs, k)) + 1e-9
        assert ours >= costs.sum() / k - 1e-9  # no partition beats the average


def test_intra_reorder_is_deterministic_and_sorted_within_rank():
    costs = np.random.default_rng(5).lognormal(0, 1, 64)
    a = intra_microbatch_reorder(costs, 8)
    assert a == intra_microbatch_reorder(costs.copy(), 8)
    assert all(g == sorted(g) for g in a)


def test_intra_reorder_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="dp_size"):
        intra_microbatch_reorder([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError, match="dp_size"):
        intra_microbatch_reorder([1.0, 2.0], 0)
    with pytest.raises(ValueError, match="costs"):
        intra_microbatch_reorder([1.0, -2.0], 2)


def test_intra_reorder_large_batch_is_near_average():
    costs = np.random.default_rng(8).lognormal(0, 1, 1920)
    groups = intra_microbatch_reorder(costs, 16)  # its time: bench/bench_reorder.py
    _assert_equal_count_partition(groups, 1920, 16)
    assert _max_load(costs, groups) < 1.001 * costs.sum() / 16


def test_build_microbatches_keeps_the_global_batch_multiset():
    rng = np.random.default_rng(3)
    costs = rng.lognormal(0, 1, 48)
    mbs = build_microbatches(costs, dp_size=4, num_microbatches=3)
    assert len(mbs) == 3 and all(len(mb) == 4 for mb in mbs)
    flat = [i for mb in mbs for rank in mb for i in rank]
    assert Counter(flat) == Counter(range(48))
    for j, mb in enumerate(mbs):  # microbatch j holds the loader's j-th chunk, balanced
        assert sorted(i for rank in mb for i in rank) == list(range(16 * j, 16 * j + 16))
        assert {len(rank) for rank in mb} == {4}
    with pytest.raises(ValueError, match="num_microbatches"):
        build_microbatches(costs, dp_size=4, num_microbatches=5)


def test_apply_order_permutes_and_validates():
    assert apply_order(["a", "b", "c"], [2, 0, 1]) == ["c", "a", "b"]
    with pytest.raises(ValueError, match="order"):
        apply_order(["a", "b"], [0, 0])


# ------------------------------------------------------------------ inter-microbatch


def _random_case(rng, m, p, kind):
    if kind == 0:  # every stage independently heterogeneous
        fwd = rng.lognormal(0, 0.8, (m, p))
    elif kind == 1:  # one size per microbatch, same on every stage
        fwd = np.repeat(rng.lognormal(0, 0.8, (m, 1)), p, axis=1)
    else:  # DistTrain-like: encoder and generator vary, LLM stages constant
        fwd = np.ones((m, p))
        fwd[:, 0] = rng.lognormal(0, 0.8, m)
        fwd[:, -1] = rng.lognormal(0, 0.8, m)
    return fwd, 2 * fwd


def _brute_force_inter(fwd, bwd, comm=None) -> float:
    perms = np.array(list(itertools.permutations(range(fwd.shape[0]))))
    return float(makespan_batch(fwd, bwd, perms, comm).min())


def _span(fwd, bwd, order, comm=None) -> float:
    o = list(order)
    return makespan_1f1b(fwd[o], bwd[o], None if comm is None else np.asarray(comm)[o])


def test_inter_reorder_matches_brute_force_on_paper_example():
    x = 1000 * np.array([1, 0.5, 2, 0.7, 1.5, 0.6])
    fwd = np.repeat(x[:, None], 4, axis=1)
    order = inter_microbatch_reorder(fwd, 2 * fwd)
    assert sorted(order) == list(range(6))
    assert _span(fwd, 2 * fwd, order) == pytest.approx(30_900)


@pytest.mark.parametrize("exhaustive_max", [8, 0])  # 0: local search only, no enumeration
def test_inter_reorder_optimal_within_1pct_of_brute_force(exhaustive_max):
    rng = np.random.default_rng(7)
    for trial in range(10):
        m, p = int(rng.integers(3, 8)), int(rng.integers(2, 6))
        fwd, bwd = _random_case(rng, m, p, trial % 3)
        comm = rng.uniform(0, 0.2, (m, p - 1)) if trial % 4 == 0 else None
        order = inter_microbatch_reorder(fwd, bwd, comm, exhaustive_max=exhaustive_max,
                                         time_budget_s=0.3)
        assert sorted(order) == list(range(m))
        assert _span(fwd, bwd, order, comm) <= 1.01 * _brute_force_inter(fwd, bwd, comm) + 1e-9


def test_inter_reorder_never_worse_than_input_or_paper_order():
    rng = np.random.default_rng(9)
    for trial in range(6):
        m, p = int(rng.integers(9, 30)), int(rng.integers(2, 8))
        fwd, bwd = _random_case(rng, m, p, trial % 3)
        order = inter_microbatch_reorder(fwd, bwd, time_budget_s=0.1)
        ours = _span(fwd, bwd, order)
        assert ours <= _span(fwd, bwd, range(m)) + 1e-9
        assert ours <= _span(fwd, bwd, paper_inter_order(fwd, bwd)) + 1e-9


def test_paper_order_puts_smallest_microbatches_last_and_first():
    rng = np.random.default_rng(4)
    m, p = 20, 4
    fwd, bwd = _random_case(rng, m, p, 1)
    order = paper_inter_order(fwd, bwd)
    assert sorted(order) == list(range(m))
    by_size = list(np.argsort(fwd.sum(axis=1)))
    assert set(order[-(p - 1):]) == set(by_size[:p - 1])  # cool-down: the p-1 smallest
    assert order[0] == by_size[p - 1]  # then the smallest of the rest opens the pipeline


def test_paper_order_improves_on_sorted_descending_input():
    # Largest-first input fills the pipeline slowly and drains it slowly.
    x = np.sort(np.random.default_rng(6).lognormal(0, 1, 16))[::-1]
    fwd = np.repeat(x[:, None], 4, axis=1)
    assert _span(fwd, 2 * fwd, paper_inter_order(fwd, 2 * fwd)) < _span(fwd, 2 * fwd, range(16))


def test_inter_reorder_240x10_stops_at_its_time_budget():
    """Measured on a clock that advances 10 ms per reading: the search reads it about
    budget / 10 ms times and stops (wall time would make the test depend on the machine's load)."""
    rng = np.random.default_rng(12)
    fwd, bwd = _random_case(rng, 240, 10, 2)
    reads = []

    def clock() -> float:
        reads.append(None)
        return 0.01 * len(reads)

    order = inter_microbatch_reorder(fwd, bwd, time_budget_s=0.5, clock=clock)
    assert 0.5 / 0.01 <= len(reads) <= 0.5 / 0.01 + 3  # stopped within a step of its deadline
    assert sorted(order) == list(range(240))
    assert _span(fwd, bwd, order) <= _span(fwd, bwd, paper_inter_order(fwd, bwd)) + 1e-9


def test_inter_reorder_rejects_bad_shapes():
    with pytest.raises(ValueError, match="bwd"):
        inter_microbatch_reorder(np.ones((3, 2)), np.ones((3, 3)))
    with pytest.raises(ValueError, match="fwd"):
        inter_microbatch_reorder(np.ones(3), np.ones(3))

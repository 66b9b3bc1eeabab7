"""Per-module post-balancing's assignment: optimal on small cases, deterministic, bounded, within its counts."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from disttrain_ds.reorder.post_balance import HOME_GAIN, assign, load_ratio, lower_bound, share_cap


def _score(costs, groups):
    loads = np.array([sum(costs[i] for i in g) for g in groups])
    return loads.max(), (loads * loads).sum()


def _brute(costs, replicas, floor, cap):
    best = None
    for owner in itertools.product(range(replicas), repeat=len(costs)):
        counts = np.bincount(owner, minlength=replicas)
        if counts.min() < floor or counts.max() > cap:
            continue
        groups = [[i for i, o in enumerate(owner) if o == r] for r in range(replicas)]
        s = _score(costs, groups)
        if best is None or s[0] < best[0] - 1e-9 or (abs(s[0] - best[0]) <= 1e-9 and s[1] < best[1] - 1e-9):
            best = s
    return best


@pytest.mark.parametrize("seed", range(12))
def test_assignment_is_optimal_on_small_cases_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, replicas = int(rng.integers(3, 9)), int(rng.integers(2, 4))
    costs = list(rng.lognormal(0, 1.2, n) * (rng.random(n) < 0.8))  # zeros: samples without work here
    floor, cap = 1, max(-(-n // replicas), int(rng.integers(-(-n // replicas), n - replicas + 2)))
    groups = assign(costs, replicas, floor, cap)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert all(floor <= len(g) <= cap for g in groups) and all(g == sorted(g) for g in groups)
    got, want = _score(costs, groups), _brute(costs, replicas, floor, cap)
    assert got[0] == pytest.approx(want[0], rel=1e-9)  # the largest load is the optimum


def test_unequal_counts_put_a_heavy_sample_alone_where_equal_blocks_cannot():
    costs = [12.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    groups = assign(costs, 2, floor=1, cap=7)
    assert sorted(map(len, groups)) == [1, 7] and load_ratio(costs, groups) == pytest.approx(12 / 9.5)
    # Negative control: equal counts (the single-order split) leave the heavy replica at 15 of 19.
    even = assign(costs, 2, floor=4, cap=4)
    assert load_ratio(costs, even) == pytest.approx(15 / 9.5)


def test_same_costs_give_the_same_assignment_and_the_search_stays_bounded():
    rng = np.random.default_rng(7)
    costs = list(rng.lognormal(0, 1.5, 64))
    t0 = time.perf_counter()
    first = assign(costs, 8, cap=share_cap(64, 8, 2.0))
    assert time.perf_counter() - t0 < 5.0  # a node budget, not a clock, bounds it (generous for loaded machines)
    assert first == assign(costs, 8, cap=share_cap(64, 8, 2.0))
    bound = lower_bound(costs, 8)
    loads = [sum(costs[i] for i in g) for g in first]
    assert max(loads) <= 1.02 * bound


@pytest.mark.parametrize("args,match", [
    (([1.0, -1.0], 2), "finite values >= 0"),
    (([1.0, 2.0, 3.0], 2, 2, 2), "do not fit"),
    (([1.0], 0), "replicas"),
])
def test_bad_input_is_one_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        assign(*args)


def test_share_cap_counts_the_most_samples_a_replica_may_take():
    assert share_cap(8, 4, 2.0) == 4 and share_cap(8, 4, 1.0) == 2 and share_cap(3, 2, 5.0) == 3


def test_memory_estimate_counts_the_most_samples_a_post_balanced_replica_may_take():
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.recipe.schema import load_recipe

    layout = ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.encoder.dp=2",
              "parallel.generator.dp=2", "train.micro_batch=2", "train.global_batch=8"]
    even = {(r.module, r.stage): r for r in estimate(load_recipe("tiny_cpu", layout))}
    post = {(r.module, r.stage): r for r in estimate(load_recipe("tiny_cpu", [*layout, "parallel.post_balance=true",
                                                                            "parallel.post_balance_share=1.5"]))}
    assert even[("encoder", 0)].samples == 2 and post[("encoder", 0)].samples == 3  # ceil(4 / 2 * 1.5)
    assert post[("encoder", 0)].activations > even[("encoder", 0)].activations
    assert post[("llm", 0)].samples == even[("llm", 0)].samples == 2  # the LLM keeps its blocks


@pytest.mark.parametrize("seed", range(10))
def test_the_lower_bound_never_exceeds_the_optimum_and_is_tight_for_equal_units(seed):
    rng = np.random.default_rng(100 + seed)
    n, replicas = int(rng.integers(2, 9)), int(rng.integers(2, 4))
    costs = list(rng.lognormal(0, 1.0, n) * (rng.random(n) < 0.8))
    best = _brute(costs, replicas, 0, n)[0]
    assert lower_bound(costs, replicas) <= best * (1 + 1e-12)
    # Equal units: ceil(n / replicas) of them on the fullest replica, more than the mean load.
    assert lower_bound([2.0] * n, replicas) == pytest.approx(2.0 * -(-n // replicas))
    # Negative control: the mean and the heaviest unit alone are below that when n > replicas does not divide.
    if n > replicas and n % replicas:
        assert max(2.0, 2.0 * n / replicas) < lower_bound([2.0] * n, replicas)


@pytest.mark.parametrize("seed", range(8))
def test_units_stay_home_unless_balance_needs_them_elsewhere(seed):
    rng = np.random.default_rng(200 + seed)
    n, replicas = int(rng.integers(6, 30)), int(rng.integers(2, 5))
    costs = list(rng.lognormal(0, 1.0, n))
    home = sorted(int(x) for x in rng.integers(0, replicas, n))  # contiguous blocks of unequal size
    free, kept = assign(costs, replicas, 0), assign(costs, replicas, 0, home=home)
    top = lambda groups: max(sum(costs[i] for i in g) for g in groups)  # noqa: E731
    # As balanced as without a home, up to HOME_GAIN (or within GOOD_ENOUGH of the lower bound)...
    assert top(kept) <= max(top(free) * (1 + HOME_GAIN), lower_bound(costs, replicas) * (1 + 1e-3)) * (1 + 1e-9)
    # ...with no more units away from home.
    moved = lambda groups: sum(home[i] != r for r, g in enumerate(groups) for i in g)  # noqa: E731
    assert moved(kept) <= moved(free)


def test_a_balanced_home_moves_nothing_where_lpt_would_reshuffle():
    costs, home = [2.0, 2.0, 3.0, 1.0], [0, 0, 1, 1]  # both replicas already at 4, the bound
    assert assign(costs, 2, 0, home=home) == [[0, 1], [2, 3]]
    assert assign(costs, 2, 0) == [[2, 3], [0, 1]]  # negative control: LPT swaps every unit's replica

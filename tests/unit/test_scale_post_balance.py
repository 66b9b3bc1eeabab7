"""The iteration simulator with per-module post-balancing: replicas split each step's samples or units
by LPT with room, loads are conserved, and heavy samples stop pacing a whole replica."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.planner.iteration_sim import PostBalance, replica_loads, sample_times, simulate_iteration
from disttrain_ds.planner.optimize import Degrees, build_plan
from disttrain_ds.reorder.post_balance import assign, lower_bound, share_cap

LAYOUT = {"encoder": Degrees(4, 1, 1), "llm": Degrees(2, 1, 2), "generator": Degrees(4, 1, 1)}


def _plan(batch: int = 32):
    mods = {n: {"layers": 4, "cost_ms": {"1": c}} for n, c in (("encoder", 8.0), ("llm", 20.0), ("generator", 9.0))}
    return build_plan(profile_from_dict({"gpus": 64, "global_batch": batch, "microbatch": 4, "peak_tflops": 312,
                                         "modules": mods}), LAYOUT)


def _workload(p, seed: int):
    """Per sample: images 0..6 (one unit each, lognormal sizes), targets 0 or 1..4 of equal cost."""
    rng = np.random.default_rng(seed)
    n = p.microbatches * p.llm.dp * p.llm.samples_per_microbatch
    images = [rng.lognormal(0, 0.8, int(k)) for k in rng.integers(0, 7, n)]
    targets = [np.ones(int(k)) for k in np.where(rng.random(n) < 0.5, 0, rng.integers(1, 5, n))]
    flops = np.column_stack([[u.sum() for u in images], rng.uniform(0.8, 1.2, n), [u.sum() for u in targets]])
    shares = {"encoder": [u / u.sum() if len(u) else u for u in images],
              "generator": [u / u.sum() if len(u) else u for u in targets]}
    return sample_times(flops, p), shares


def test_post_balanced_loads_are_conserved_and_within_lpt_of_the_best_split():
    p = _plan()
    times, shares = _workload(p, 0)
    post = PostBalance.of(shares)
    arrangement = np.arange(len(times))
    d = p.llm.dp * p.llm.samples_per_microbatch
    blocks = replica_loads(times, p, arrangement)
    balanced = replica_loads(times, p, arrangement, post)
    for j, name in enumerate(p.modules):
        steps = times[:, j].reshape(-1, d)
        assert balanced[j].sum(axis=1) == pytest.approx(steps.sum(axis=1), rel=1e-9)  # nothing lost or doubled
        if name == "llm":
            assert np.array_equal(balanced[j], blocks[j])  # the LLM keeps its blocks
            continue
        for k, step in enumerate(steps):
            units = np.concatenate([shares[name][i] * times[i, j] for i in range(k * d, (k + 1) * d)])
            cap = share_cap(len(units), p.module(name).dp, 2.0)
            best = max(units[g].sum() for g in assign(units, p.module(name).dp, 1 if len(units) >= 4 else 0, cap))
            assert lower_bound(units, 4) - 1e-9 <= best <= balanced[j][k].max() + 1e-9
            assert balanced[j][k].max() <= 4 / 3 * best + 1e-9  # LPT's guarantee
        assert balanced[j].max(axis=1).mean() < blocks[j].max(axis=1).mean()  # splitting units pays


def test_post_balancing_shortens_the_simulated_iteration_on_skewed_steps():
    p = _plan()
    times, shares = _workload(p, 1)
    blocks = simulate_iteration(times, p).makespan_ms
    post = simulate_iteration(times, p, post=PostBalance.of(shares)).makespan_ms
    samples_only = simulate_iteration(times, p, post=PostBalance()).makespan_ms
    assert post < samples_only <= blocks * 1.02
    assert post < 0.97 * blocks
    # Negative control: uniform costs leave nothing to balance; post-balancing only adds links.
    flat = sample_times(np.ones((len(times), 3)), p)
    assert simulate_iteration(flat, p, post=PostBalance()).makespan_ms == pytest.approx(
        simulate_iteration(flat, p).makespan_ms, rel=1e-9)

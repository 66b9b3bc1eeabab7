"""Every feasible layout, and the lower bound on each one's simulated iteration."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_hetero import GRAPHS, random_data

from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.climb import layout_bound
from disttrain_ds.planner.every_layout import every_layout
from disttrain_ds.planner.iteration_sim import VARIANTS, sample_times, simulate_iteration, simulate_scaled
from disttrain_ds.planner.objective import Degrees, straggler_table, t_iter
from disttrain_ds.planner.optimize import PlanError, build_plan, exhaustive_layouts, exhaustive_plan
from disttrain_ds.planner.sim_bound import SimBound, unit_times


def brute_force_layouts(profile) -> set[tuple]:
    """Every feasible layout by nested loops over each module's degrees."""
    return {tuple(x.values()) for x in exhaustive_layouts(profile)}


def listed(profile) -> list[tuple]:
    return [tuple(s.degrees(i).values()) for s in every_layout(profile) for i in range(len(s))]


@pytest.mark.parametrize("graph, seed", [(g, s) for g in GRAPHS for s in range(6)])
def test_every_layout_lists_each_feasible_layout_once(graph, seed):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=8))
    found = listed(profile)
    assert len(found) == len(set(found))
    assert set(found) == brute_force_layouts(profile)


@pytest.mark.parametrize("seed", range(6))
def test_the_best_listed_layout_is_the_planners_exact_optimum(seed):
    profile = profile_from_dict(random_data(GRAPHS["chain"], seed, draw=8))
    table = straggler_table(profile)
    try:
        best = exhaustive_plan(profile)
    except PlanError:
        assert listed(profile) == []
        return
    found = [dict(zip(profile.graph.names, x)) for x in listed(profile)]
    assert min(t_iter(profile, x, table).total_ms for x in found) == best.t_iter_ms


def simulated(profile, layout, flops, batches, variant, lock_step=False):
    p = build_plan(profile, layout)
    times = sample_times(flops, p).reshape(batches, profile.global_batch, -1)
    intra, inter = VARIANTS[variant]
    return float(np.mean([simulate_iteration(t, p, intra=intra, inter=inter, budget_s=0.01, seed=i,
                                             lock_step=lock_step).makespan_ms for i, t in enumerate(times)]))


FEASIBLE = {"chain": (0, 1, 2, 3), "two_encoders": (0, 1, 3, 4), "two_generators": (0, 1, 2, 3)}
"""Seeds whose random instance has feasible layouts."""


@pytest.mark.parametrize("graph, seed", [(g, s) for g in GRAPHS for s in FEASIBLE[g]])
def test_no_layout_simulates_faster_than_its_bound(graph, seed):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=8))
    layouts = [dict(zip(profile.graph.names, x)) for x in listed(profile)]
    assert layouts
    rng = np.random.default_rng(seed)
    batches = 2
    flops = rng.lognormal(0, 1.0, (batches * profile.global_batch, len(layouts[0])))
    flops[rng.random(flops.shape) < 0.2] = 0.0  # samples a module does nothing for
    anyhow = SimBound(profile.graph, unit_times(flops, batches))
    ordered = SimBound(profile.graph, unit_times(flops, batches), ordered=True)
    for i, layout in enumerate(layouts[:: max(1, len(layouts) // 25)]):
        lb, lb_ordered = layout_bound(profile, anyhow, layout), layout_bound(profile, ordered, layout)
        variant = list(VARIANTS)[i % len(VARIANTS)]
        assert lb <= simulated(profile, layout, flops, batches, variant, lock_step=i % 5 == 0) * (1 + 1e-12)
        assert lb <= lb_ordered * (1 + 1e-12)  # knowing the order only tightens it
        assert lb_ordered <= simulated(profile, layout, flops, batches, "none", lock_step=i % 5 == 0) * (1 + 1e-12)


def test_the_bound_is_the_simulated_time_of_a_pipeline_of_equal_samples():
    profile = profile_from_dict({"gpus": 8, "global_batch": 16, "gpus_per_node": 4, "modules": {
        "llm": {"layers": 8, "cost_ms": {"1": 40.0}}, "generator": {"layers": 2, "cost_ms": {"1": 1e-9}}}})
    layout = {"llm": Degrees(2, 1, 4), "generator": Degrees(1, 1, 1)}
    flops = np.ones((16, 2))
    sim = simulated(profile, layout, flops, 1, "none")
    for ordered in (False, True):
        lb = layout_bound(profile, SimBound(profile.graph, unit_times(flops, 1), ordered), layout)
        assert lb == pytest.approx(sim, rel=1e-6)
        assert lb == pytest.approx((8 + 3) * 40.0 / 4)  # K = 8 steps, 4 stages, 10 ms per stage


def test_a_bound_priced_at_mean_loads_is_caught_by_the_simulation():
    # Negative control: pricing the stages before the busiest one at the mean step load instead
    # of the cheapest m samples is not a bound, and the comparison above shows it.
    def caught(graph: str, seed: int) -> bool:
        profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=8))
        layouts = [dict(zip(profile.graph.names, x)) for x in listed(profile)]
        if not layouts:
            return False
        flops = np.random.default_rng(seed).lognormal(0, 1.0, (profile.global_batch, len(layouts[0])))
        bound = SimBound(profile.graph, unit_times(flops, 1))
        mean = bound._total[:, None, :] / profile.global_batch  # [batches, 1, modules]
        bound._cheapest = np.arange(profile.global_batch + 1)[None, :, None] * mean
        return any(layout_bound(profile, bound, x) > simulated(profile, x, flops, 1, "none") * (1 + 1e-9)
                   for x in layouts[:: max(1, len(layouts) // 40)])

    assert any(caught(g, s) for g in GRAPHS for s in range(8))


def test_unit_times_normalise_as_the_simulation_does():
    profile = profile_from_dict(random_data(GRAPHS["chain"], 1, draw=8))
    layout = dict(zip(profile.graph.names, listed(profile)[0]))
    p = build_plan(profile, layout)
    flops = np.random.default_rng(0).lognormal(0, 1, (2 * profile.global_batch, 3))
    flops[:, 2] = 0.0  # a module with no work in the batch: every sample at its mean cost
    cost = np.array([profile.modules[n].cost(d.tp, d.sp) for n, d in layout.items()])
    np.testing.assert_allclose(unit_times(flops, 2).reshape(-1, 3) * cost, sample_times(flops, p))


@pytest.mark.parametrize("bad, match", [(np.ones((2, 3)), r"\[batches, global_batch, 3\]"),
                                        (-np.ones((1, 2, 3)), "non-negative")])
def test_bad_times_are_refused_in_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        SimBound(ModuleGraph.default(), bad)


@pytest.mark.parametrize("seed", (0, 3, 4, 6))  # instances with layouts that differ only in TP
def test_layouts_differing_in_tp_simulate_in_one_sweep_as_one_by_one(seed):
    profile = profile_from_dict(random_data(GRAPHS["two_encoders"], seed, draw=8))
    found = listed(profile)
    assert found
    shape = {n: (d.dp, d.pp) for n, d in zip(profile.graph.names, found[len(found) // 2])}
    same = [dict(zip(profile.graph.names, x)) for x in found
            if {n: (d.dp, d.pp) for n, d in zip(profile.graph.names, x)} == shape]
    assert len(same) >= 2
    flops = np.random.default_rng(seed).lognormal(0, 1, (profile.global_batch, len(shape)))
    unit = unit_times(flops, 1)[0]
    cost = np.array([[profile.modules[n].cost(d.tp, d.sp) for n, d in x.items()] for x in same])
    one_sweep = simulate_scaled(unit, build_plan(profile, same[0]), cost)
    np.testing.assert_allclose(one_sweep, [simulated(profile, x, flops, 1, "none") for x in same], rtol=1e-12)

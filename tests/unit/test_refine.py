"""The step estimate and the refinement of the finalists (``planner/refine.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_hetero import GRAPHS, random_data
from test_planner_sp import with_auto
from test_sim_bound import FEASIBLE, brute_force_layouts, listed, simulated

from disttrain_ds.cost.profile import AUTO_SP
from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.planner import climb, optimize
from disttrain_ds.planner.objective import Degrees, straggler_table
from disttrain_ds.planner.optimize import build_plan, plan, simulated_ms
from disttrain_ds.planner.refine import StepEstimate, refine
from disttrain_ds.planner.search import finalists
from disttrain_ds.planner.sim_bound import unit_times


def by_definition(profile, layout, unit: np.ndarray) -> float:
    """The estimate from its definition, slot by slot and stage by stage."""
    graph = profile.graph
    d = layout[graph.llm].dp * profile.microbatch
    k = profile.global_batch // d
    offsets, stages = graph.stage_offsets({n: layout[n].pp for n in graph.names})
    total = 0.0
    for batch in unit:
        for t in range(k + stages - 1):
            slot = 0.0
            for j, n in enumerate(graph.names):
                x = layout[n]
                for q in range(x.pp):
                    mb = t - offsets[n] - q
                    if 0 <= mb < k:
                        step = batch[mb * d:(mb + 1) * d, j].reshape(x.dp, -1).sum(axis=1)
                        slot = max(slot, step.max() * profile.modules[n].cost(x.tp, x.sp) / x.pp)
            total += slot
    return total / len(unit)


@pytest.mark.parametrize("graph, seed", [(g, s) for g in GRAPHS for s in FEASIBLE[g]])
def test_the_estimate_is_its_definition_and_no_module_alone_exceeds_it(graph, seed):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=8))
    layouts = [dict(zip(profile.graph.names, x)) for x in listed(profile)]
    rng = np.random.default_rng(seed)
    flops = rng.lognormal(0, 1.0, (2 * profile.global_batch, len(profile.graph.names)))
    flops[rng.random(flops.shape) < 0.2] = 0.0  # samples a module does nothing for
    unit = unit_times(flops, 2)
    est = StepEstimate(profile, unit)
    for layout in layouts[:: max(1, len(layouts) // 20)]:
        e = est.estimate(layout)
        assert e == pytest.approx(by_definition(profile, layout, unit), rel=1e-12)
        d = layout[profile.graph.llm].dp * profile.microbatch
        assert max(est.term(n, x, d) for n, x in layout.items()) <= e * (1 + 1e-12)


def test_with_equal_samples_the_estimate_is_the_simulated_pipeline():
    profile = profile_from_dict({"gpus": 8, "global_batch": 16, "gpus_per_node": 4, "modules": {
        "encoder": {"layers": 2, "cost_ms": {"1": 10.0}}, "llm": {"layers": 8, "cost_ms": {"1": 40.0}}}})
    layout = {"encoder": Degrees(2, 1, 1), "llm": Degrees(2, 1, 4)}  # every stage 10 ms per step
    flops = np.ones((16, 2))
    e = StepEstimate(profile, unit_times(flops, 1)).estimate(layout)
    assert e == pytest.approx((8 + 5 - 1) * 10.0)  # K = 8 steps through 5 stages
    assert e == pytest.approx(simulated(profile, layout, flops, 1, "none"), rel=1e-9)


def test_the_estimate_waits_for_each_steps_slowest_replica_where_mean_loads_do_not():
    # Negative control: the same definition at each step's mean replica load misses the stragglers
    # that a skewed draw puts in single steps, and ranks the two layouts the other way round.
    profile = profile_from_dict({"gpus": 8, "global_batch": 16, "gpus_per_node": 8, "modules": {
        "encoder": {"layers": 2, "cost_ms": {"1": 10.0, "2": 5.2}}, "llm": {"layers": 8, "cost_ms": {"1": 8.0}}}})
    flops = np.ones((16, 2))
    flops[::4, 0] = 8.0  # one sample in four costs the encoder 8x
    unit = unit_times(flops, 1)
    spread = {"encoder": Degrees(4, 1, 1), "llm": Degrees(4, 1, 1)}  # replicas 1-3 idle beside replica 0
    wide = {"encoder": Degrees(1, 2, 1), "llm": Degrees(4, 1, 1)}  # one replica, no straggler
    est = StepEstimate(profile, unit)
    mean = StepEstimate(profile, unit)
    mean._slowest = {(0, 4, 1): unit[:, :, 0].reshape(1, 4, 4, 1).sum(axis=3).mean(axis=2),
                     (0, 1, 4): unit[:, :, 0].reshape(1, 4, 1, 4).sum(axis=3).mean(axis=2)}
    assert est.estimate(wide) < est.estimate(spread)
    assert mean.estimate(wide) > mean.estimate(spread)
    sim = {n: simulated(profile, x, flops, 1, "none") for n, x in (("wide", wide), ("spread", spread))}
    assert sim["wide"] < sim["spread"]  # the simulation agrees with the estimate


@pytest.mark.parametrize("graph, seed", [(g, s) for g in GRAPHS for s in FEASIBLE[g]])
def test_refined_layouts_are_feasible_ranked_and_no_worse_than_the_start(graph, seed):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=64))
    table = straggler_table(profile)
    caps = {n: profile.gpus for n in profile.graph.names}
    memo: dict = {}
    starts = finalists(profile, caps, table, True, 2, memo)
    unit = optimize.sim_unit_times(profile)
    est = StepEstimate(profile, unit)
    found = refine(profile, starts, est, memo, 6)
    values = [est.estimate(x) for x in found]
    keys = {tuple(x[n] for n in profile.graph.names) for x in found}
    assert found and values == sorted(values) and len(keys) == len(found)
    assert values[0] <= min(est.estimate(x) for x in starts)
    assert keys <= brute_force_layouts(profile)


SKEWED = {"gpus": 32, "global_batch": 64, "microbatch": 1, "gpus_per_node": 8}
"""A long-tailed workload (lognormal sigma 1 in the encoder and generator) where the closed
form's finalists miss the fastest layout."""


def skewed_profile():
    rng = np.random.default_rng(1)
    mean = {"encoder": 90.0, "llm": 400.0, "generator": 70.0}
    layers = {"encoder": 32, "llm": 32, "generator": 12}
    sigma = {"encoder": 1.0, "llm": 0.05, "generator": 1.0}
    mods = {}
    for n in mean:
        draw = rng.lognormal(0, sigma[n], 1024)
        mods[n] = {"layers": layers[n], "cost_ms": {str(t): mean[n] / (t * 0.9 ** np.log2(t)) for t in (1, 2, 4, 8)},
                   "sample_cost_ms": (draw * mean[n] / draw.mean()).tolist()}
    return profile_from_dict({**SKEWED, "modules": mods})


def test_the_plan_takes_a_refined_layout_when_it_simulates_faster(monkeypatch):
    profile = skewed_profile()
    monkeypatch.setattr(climb, "ROUNDS", 0)
    chosen = plan(profile)
    monkeypatch.setattr(optimize, "REFINED", 0)  # negative control: the finalists alone
    monkeypatch.setattr(climb, "ROUNDS", 0)  # (no descent either: it would find the layout too)
    alone = plan(profile)
    monkeypatch.undo()
    assert chosen.t_sim_ms < alone.t_sim_ms * 0.98
    assert chosen.t_sim_ms == pytest.approx(simulated_ms(profile, build_plan(profile, chosen.degrees())))
    table = straggler_table(profile)
    caps = {n: profile.gpus for n in profile.graph.names}
    found = finalists(profile, caps, table, True, 4) + finalists(profile, caps, None, True, 4)
    assert chosen.degrees() not in found


def test_layouts_with_adaptive_groups_are_left_to_the_finalists():
    for seed in range(12):  # an instance whose finalists include adaptive groups
        profile = profile_from_dict(with_auto(seed))
        auto = [x for x in finalists(profile, {n: profile.gpus for n in profile.graph.names},
                                     straggler_table(profile), True, 8) if x[profile.graph.llm].sp == AUTO_SP]
        if auto:
            break
    assert auto
    unit = unit_times(np.ones((profile.global_batch, len(profile.graph.names))), 1)
    assert refine(profile, auto[:1], StepEstimate(profile, unit), {}, 4) == []
    plain = {**auto[0], profile.graph.llm: auto[0][profile.graph.llm]._replace(sp=1)}
    found = refine(profile, [plain], StepEstimate(profile, unit), {}, 4)
    assert found and all(x[n].sp != AUTO_SP for x in found for n in x)


def test_refined_layouts_keep_the_callers_gpu_caps_and_node_rule():
    profile = skewed_profile()
    caps = {"encoder": 4, "llm": 24, "generator": 4}
    for aligned in (True, False):
        chosen = plan(profile, gpu_caps=caps, aligned=aligned)
        assert all(chosen.modules[n].gpus <= caps[n] for n in caps), chosen.degrees()
    memo: dict = {}
    table = straggler_table(profile)
    starts = finalists(profile, caps, table, True, 4, memo)
    unit = optimize.sim_unit_times(profile)
    capped = refine(profile, starts, StepEstimate(profile, unit), memo, 8, caps)
    assert capped and all(x[n].gpus <= caps[n] for x in capped for n in caps)
    # Negative control: without the caps the refinement leaves them.
    free = refine(profile, starts, StepEstimate(profile, unit), memo, 8)
    assert any(x[n].gpus > caps[n] for x in free for n in caps)

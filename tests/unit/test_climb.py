"""The descent on the simulated iteration (``planner/climb.py``) and the sweep it runs on."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner_hetero import GRAPHS, random_data
from test_sim_bound import FEASIBLE, brute_force_layouts

from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.paper.scale import sample_cost_draw, tp_costs
from disttrain_ds.planner import climb, optimize
from disttrain_ds.planner.climb import SimulatedTimes
from disttrain_ds.planner.iteration_sim import sample_times, simulate_iteration, simulate_scaled
from disttrain_ds.planner.neighbours import Feasible, degrees_of
from disttrain_ds.planner.objective import straggler_table
from disttrain_ds.planner.optimize import build_plan, plan, simulated_ms
from disttrain_ds.planner.search import batch_splits, finalists
from disttrain_ds.planner.sim_bound import unit_times


def one_module_changes(profile, layout) -> list[dict]:
    """Every feasible layout (brute force) that differs from ``layout`` in one module's degrees
    (the LLM's at any DP, so at another samples-per-step split)."""
    names = profile.graph.names
    out = []
    for key in brute_force_layouts(profile):
        other = dict(zip(names, key))
        if sum(other[n] != layout[n] for n in names) == 1:
            out.append(other)
    return out


@pytest.mark.parametrize("graph, seed", [(g, s) for g in GRAPHS for s in FEASIBLE[g]])
def test_the_descent_ends_where_no_one_module_change_simulates_faster(graph, seed):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=64))
    table = straggler_table(profile)
    caps = {n: profile.gpus for n in profile.graph.names}
    memo: dict = {}
    start = finalists(profile, caps, table, True, 1, memo)[0]
    unit = optimize.sim_unit_times(profile)
    build = lambda x: build_plan(profile, x, table=table, predicted=False)  # noqa: E731
    times = SimulatedTimes(profile, unit, build)
    end, t = climb.climb(profile, start, unit, Feasible(profile, memo, caps, True), build)
    assert tuple(end[n] for n in profile.graph.names) in brute_force_layouts(profile)
    assert t == pytest.approx(float(times([end])[0]), rel=1e-12)
    assert t <= float(times([start])[0])
    # Every neighbour by brute force, bound-pruned or not, simulates no faster.
    for other in one_module_changes(profile, end):
        assert float(times([other])[0]) >= t * (1 - 1e-9), other


def test_without_moves_the_start_is_often_not_where_the_descent_ends():
    # Negative control of the test above: the closed form's best layout has a faster one-module
    # change on some of the same instances, so "no faster neighbour" is not met by any layout.
    moved = 0
    for graph, seed in ((g, s) for g in GRAPHS for s in FEASIBLE[g]):
        profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=64))
        table = straggler_table(profile)
        start = finalists(profile, {n: profile.gpus for n in profile.graph.names}, table, True, 1)[0]
        times = SimulatedTimes(profile, optimize.sim_unit_times(profile),
                               lambda x: build_plan(profile, x, table=table, predicted=False))
        t = float(times([start])[0])
        moved += any(float(times([x])[0]) < t * (1 - 1e-9) for x in one_module_changes(profile, start))
        if moved == 2:
            break
    assert moved == 2


def multimodal_profile(seed: int = 1, gpus: int = 256, mean: dict | None = None, llm_layers: int = 40,
                       batch: int = 128) -> dict:
    """Interleaved samples (Zipf image counts, about half text-only, 7 in 10 generating nothing); by
    default 256 GPUs and global batch 128, where the closed forms' layouts and the refinement's
    miss the fastest layout by some 20 %."""
    rng = np.random.default_rng([seed, 1])
    n = 1024
    images = np.minimum(rng.zipf(1.8, n) - 1, 32) * rng.lognormal(0, 0.1, n)
    generated = np.where(rng.random(n) < 0.3, rng.geometric(0.5, n), 0).astype(np.float64)
    flops = np.column_stack([images, rng.lognormal(0, 0.2, n) + 0.25 * (images + generated), generated])
    mean = mean or {"encoder": 291.7, "llm": 507.1, "generator": 87.26}
    layers = {"encoder": 32, "llm": llm_layers, "generator": 12}
    draws = sample_cost_draw(flops, list(mean.values()))
    mods = {m: {"layers": layers[m], "cost_ms": tp_costs(mean[m], 1), "sample_cost_ms": d}
            for m, d in zip(mean, draws)}
    return {"gpus": gpus, "global_batch": batch, "microbatch": 1, "gpus_per_node": 8, "modules": mods}


@pytest.fixture(scope="module")
def multimodal():
    """The multimodal profile and its plan."""
    profile = profile_from_dict(multimodal_profile())
    return profile, plan(profile)


def test_the_plan_descends_to_a_faster_layout_than_every_ranked_candidate(monkeypatch, multimodal):
    profile, chosen = multimodal
    monkeypatch.setattr(climb, "ROUNDS", 0)  # negative control: finalists and refined layouts only
    ranked = plan(profile)
    monkeypatch.undo()
    assert chosen.t_sim_ms < ranked.t_sim_ms * 0.9
    assert chosen.t_sim_ms == simulated_ms(profile, build_plan(profile, chosen.degrees()))
    assert chosen.finalists == ranked.finalists


def test_the_descent_keeps_the_callers_gpu_caps_and_node_rule(multimodal):
    profile, free = multimodal
    caps = {n: m.gpus for n, m in free.modules.items()}
    caps["encoder"] = max(8, caps["encoder"] // 2)
    for aligned in (True, False):
        capped = plan(profile, gpu_caps=caps, aligned=aligned)
        assert all(capped.modules[n].gpus <= caps[n] for n in caps), capped.degrees()
    assert free.modules["encoder"].gpus > caps["encoder"]  # negative control: the cap binds


@pytest.mark.parametrize("seed", range(4))
def test_batches_and_tp_variants_in_one_sweep_simulate_as_one_by_one(seed):
    profile = profile_from_dict(random_data(GRAPHS["chain"], FEASIBLE["chain"][seed], draw=8))
    layout = finalists(profile, {n: profile.gpus for n in profile.graph.names}, None, True, 1)[0]
    p = build_plan(profile, layout)
    rng = np.random.default_rng(seed)
    flops = rng.lognormal(0, 1, (3 * profile.global_batch, 3))
    flops[rng.random(flops.shape) < 0.3] = 0.0
    unit = unit_times(flops, 3)
    scales = rng.uniform(0.5, 2.0, (4, 3))
    swept = simulate_scaled(unit, p, scales)
    assert swept.shape == (4, 3)
    one = [[simulate_iteration(unit[b] * s, p).makespan_ms for b in range(3)] for s in scales]
    np.testing.assert_allclose(swept, one, rtol=1e-12)
    np.testing.assert_allclose(simulate_scaled(unit[1], p, scales), swept[:, 1], rtol=0)
    # The planner's simulated time: its batches in one sweep, as simulated one at a time.
    times = sample_times(optimize._draw(profile, p.modules), p)
    each = [simulate_iteration(times[i], p).makespan_ms for i in optimize._sim_batches(profile)]
    assert simulated_ms(profile, p) == pytest.approx(np.mean(each), rel=1e-12)


def test_the_descent_steps_out_of_a_local_minimum_to_a_faster_layout(monkeypatch):
    # 64 GPUs: the descent stops at encoder 2x8x1 / LLM 4x8x1 / generator 2x2x4 (DP x TP x PP),
    # where every one-module change simulates slower; two steps through slower generators
    # (2x4x2, then 1x1x12) reach the LLM at twice the DP, 3 % faster than that minimum.
    profile = profile_from_dict(multimodal_profile(0, 64, {"encoder": 136.75, "llm": 582.18, "generator": 70.14},
                                                   llm_layers=24))
    chosen = plan(profile)
    monkeypatch.setattr(climb, "ESCAPES", 0)  # negative control: the plain descent
    stuck = plan(profile)
    assert chosen.t_sim_ms < stuck.t_sim_ms * 0.98, (chosen.degrees(), stuck.degrees())
    assert chosen.t_sim_ms == simulated_ms(profile, build_plan(profile, chosen.degrees()))
    unit = optimize.sim_unit_times(profile)
    times = SimulatedTimes(profile, unit, lambda x: build_plan(profile, x, predicted=False))
    start = stuck.degrees()
    feasible = Feasible(profile, {}, {n: profile.gpus for n in profile.graph.names}, True)
    neighbours = [{**start, n: x} for n in profile.graph.names
                  for x in degrees_of(feasible.options(n, start["llm"].dp)) if x != start[n]]
    neighbours += [{**start, "llm": x} for d in batch_splits(profile) if d != start["llm"].dp
                   for x in degrees_of(feasible.options("llm", d))]  # the LLM at other samples per step
    assert all(float(times([x])[0]) >= stuck.t_sim_ms * (1 - 1e-9) for x in neighbours if feasible(x))


def test_the_descent_realigns_the_other_modules_dp_where_no_one_module_move_leads(monkeypatch):
    # 128 GPUs, global batch 256: the descent stops at encoder 4x8x1 / LLM 8x8x1 / generator 4x8x1;
    # encoder and generator at 8x4x1 together (one replica of each per LLM replica) are 3 % faster,
    # and neither move alone is.
    data = multimodal_profile(6, 128, {"encoder": 142.04, "llm": 522.9, "generator": 148.78}, llm_layers=32,
                              batch=256)
    profile = profile_from_dict(data)
    chosen = plan(profile)
    monkeypatch.setattr(climb, "realigned", lambda layout, llm, d: [])  # negative control
    unaligned = plan(profile)
    assert chosen.t_sim_ms < unaligned.t_sim_ms * 0.98, (chosen.degrees(), unaligned.degrees())
    assert chosen.degrees()["encoder"].dp == chosen.degrees()["generator"].dp == 8
    times = SimulatedTimes(profile, optimize.sim_unit_times(profile), lambda x: build_plan(profile, x, predicted=False))
    start = unaligned.degrees()
    for n in ("encoder", "generator"):  # each module's half of the move alone is slower
        assert float(times([{**start, n: chosen.degrees()[n]}])[0]) > unaligned.t_sim_ms


def test_realigned_layouts_keep_each_modules_gpus_and_move_two_modules_or_more():
    D = climb.Degrees
    layout = {"encoder": D(4, 8, 1), "llm": D(8, 8, 1), "generator": D(2, 4, 3)}
    out = climb.realigned(layout, "llm", 8)
    assert {"encoder": D(8, 4, 1), "llm": D(8, 8, 1), "generator": D(8, 1, 3)} in out
    for x in out:
        assert x["llm"] == layout["llm"] and len({x["encoder"].dp, x["generator"].dp}) == 1
        assert all(x[n].gpus == layout[n].gpus and x[n].pp == layout[n].pp for n in layout)
        assert sum(x[n] != layout[n] for n in layout) >= 2
    # DP 1 or 2 would take the encoder to TP 32 or 16; DP 4 moves the generator alone (a neighbour already)
    assert [x["encoder"].dp for x in out] == [8]

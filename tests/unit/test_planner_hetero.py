"""Per-sample cost draws in the planner: validation, straggler factors, exact search, payoff."""

from __future__ import annotations

import itertools
import json
import math
import random
from functools import partial

import numpy as np
import pytest

from disttrain_ds.cost.profile import Profile, ProfileError
from disttrain_ds.cost.profile_file import load_profile, profile_from_dict, profile_to_dict
from disttrain_ds.paper import scale
from disttrain_ds.planner import climb, hetero, optimize
from disttrain_ds.planner.baselines import megatron_plan, ratio_plan
from disttrain_ds.planner.hetero import StragglerTable, expected_max
from disttrain_ds.planner.objective import combine, samples_per_step, straggler_table, t_iter
from disttrain_ds.planner.optimize import PlanError, build_plan, exhaustive_plan, plan, simulated_ms
from disttrain_ds.planner.refine import StepEstimate, refine
from disttrain_ds.planner.search import finalists
from disttrain_ds.reorder.intra import lpt_equal_count, lpt_rows
from disttrain_ds.schedule.simulate import makespan_1f1b

GRAPHS = {
    "chain": {"encoder": "encoder", "llm": "llm", "generator": "generator"},
    "two_encoders": {"image": "encoder", "audio": "encoder", "llm": "llm",
                     "generator": "generator"},
    "two_generators": {"llm": "llm", "image_gen": "generator", "speech_gen": "generator"},
}


def random_data(roles: dict[str, str], seed: int, draw: int = 0) -> dict:
    """A small random profile (N <= 32, BS <= 16, brute-forceable) as JSON data; ``draw`` > 0
    adds that many per-sample costs per module, lognormal with a random spread."""
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    bs = r.randint(1, 16)
    mods = {}
    for name, role in roles.items():
        tps = sorted({1} | set(r.sample([2, 4], r.randint(0, 2))))
        c1 = r.uniform(5, 200)
        mods[name] = {"layers": r.choice([1, 2, 3, 4]),
                      "cost_ms": {str(t): c1 / t ** r.uniform(0.5, 1.1) for t in tps}}
        if name != role:
            mods[name]["role"] = role
        if draw:
            mods[name]["sample_cost_ms"] = (c1 * rng.lognormal(0, r.uniform(0.1, 1.5), draw)).tolist()
    data = {"gpus": r.randint(2, 32), "global_batch": bs, "gpus_per_node": 4,
            "microbatch": r.choice([m for m in (1, 2, 4) if bs % m == 0] + [1, 1]),
            "modules": mods}
    if r.random() < 0.3:
        for m in mods.values():
            m.update(params=r.uniform(1e8, 4e9), activation_bytes_per_sample=r.uniform(1e8, 4e9))
        data["gpu_memory_gb"] = r.uniform(8, 60)
    return data


def outcome(solver, profile: Profile):
    try:
        p = solver(profile)
        return p.to_json(), [m.straggler for m in p.modules.values()]
    except PlanError as exc:
        return f"PlanError: {exc}"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("mutate, field", [
    (lambda m: m["llm"].update(sample_cost_ms=5.0), "modules.llm.sample_cost_ms"),
    (lambda m: m["llm"].update(sample_cost_ms=[]), "modules.llm.sample_cost_ms"),
    (lambda m: m["llm"]["sample_cost_ms"].__setitem__(2, -1.0), "modules.llm.sample_cost_ms[2]"),
    (lambda m: m["encoder"]["sample_cost_ms"].__setitem__(1, float("inf")),
     "modules.encoder.sample_cost_ms[1]"),
    (lambda m: m["encoder"]["sample_cost_ms"].__setitem__(1, float("nan")),
     "modules.encoder.sample_cost_ms[1]"),
    (lambda m: m["generator"]["sample_cost_ms"].__setitem__(3, "7"),
     "modules.generator.sample_cost_ms[3]"),
    (lambda m: m["generator"]["sample_cost_ms"].__setitem__(3, True),
     "modules.generator.sample_cost_ms[3]"),
    (lambda m: m["generator"]["sample_cost_ms"].append(1.0), "modules.generator.sample_cost_ms"),
    (lambda m: m["encoder"].pop("sample_cost_ms"), "modules.encoder.sample_cost_ms"),
])
def test_bad_draw_gives_one_line_naming_the_field_and_file(tmp_path, mutate, field):
    data = random_data(GRAPHS["chain"], 0, draw=6)
    mutate(data["modules"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"'{field}'" in message


def test_a_draw_with_zeros_is_real_data_and_plans(tmp_path):
    """Samples without images cost the encoder nothing, samples without targets the generator."""
    data = random_data(GRAPHS["chain"], 0, draw=8)
    data["modules"]["encoder"]["sample_cost_ms"][1::2] = [0.0] * 4
    data["modules"]["generator"]["sample_cost_ms"] = [0.0] * 7 + [40.0]
    path = tmp_path / "zeros.json"
    path.write_text(json.dumps(data))
    profile = load_profile(path)
    assert profile.modules["generator"].sample_cost_ms[0] == 0.0
    table = StragglerTable(profile)
    for dp, m, pp in [(1, 1, 1), (2, 1, 2), (2, 3, 1), (4, 2, 2)]:
        assert all(np.isfinite(table.factor(n, dp, m, pp)) and table.factor(n, dp, m, pp) >= 1.0
                   for n in profile.modules)
    # One generating sample in eight: a replica of several samples usually waits for it.
    assert table.factor("generator", 4, 2) > table.factor("llm", 4, 2)
    result = outcome(plan, profile)  # plans (or says why not) without dividing by a zero mean
    assert isinstance(result, str) or all(np.isfinite(f) for f in result[1])


def test_a_module_that_never_works_on_the_data_waits_for_nothing():
    data = random_data(GRAPHS["chain"], 0, draw=6)
    data["modules"]["generator"]["sample_cost_ms"] = [0.0] * 6
    table = StragglerTable(profile_from_dict(data))
    assert table.factor("generator", 4, 3, 2) == 1.0 and table.factor("generator", 3, 1, 2) == 1.0


def test_draw_round_trips_through_json():
    profile = profile_from_dict(random_data(GRAPHS["two_encoders"], 3, draw=5))
    back = profile_from_dict(json.loads(json.dumps(profile_to_dict(profile))))
    assert back == profile and back.modules["audio"].sample_cost_ms is not None


# --------------------------------------------------------------------------- straggler factors


def test_expected_max_of_one_sample_per_replica_is_exact_by_enumeration():
    draw = np.sort(np.array([1.0, 2.0, 7.0, 3.5]))
    for n in (1, 2, 3):
        brute = np.mean([max(c) for c in itertools.product(draw, repeat=n)])
        assert expected_max(draw, n) == pytest.approx(brute, rel=1e-12)


def test_factor_with_several_samples_is_the_lpt_balanced_max_over_the_mean():
    data = random_data(GRAPHS["chain"], 1, draw=50)
    profile = profile_from_dict(data)
    table = StragglerTable(profile, samples=64, seed=7)
    dp, m = 4, 3
    draws = np.array([data["modules"][n]["sample_cost_ms"] for n in table.names])
    steps = max(hetero.MIN_STEPS, math.ceil(64 / 12))
    idx = np.random.default_rng([7, dp, m]).integers(0, 50, (steps, 12))
    for j, name in enumerate(table.names):
        peaks, mean = [], 0.0
        for row in draws[j][idx]:  # one step at a time, through the list-of-groups LPT
            loads = [row[g].sum() for g in lpt_equal_count(row, dp)]
            peaks, mean = peaks + [max(loads)], mean + sum(loads) / dp
        mean /= steps
        assert table.factor(name, dp, m) == pytest.approx(np.mean(peaks) / mean, rel=1e-12)
        pairs = [max(a, b) for a in peaks for b in peaks]  # two steps in flight
        assert table.factor(name, dp, m, pp=2) == pytest.approx(np.mean(pairs) / mean, rel=1e-12)
        assert 1.0 <= table.factor(name, dp, m) <= table.factor(name, dp, m, pp=2)


def test_one_sample_per_replica_over_pp_steps_is_the_max_of_dp_times_pp_draws():
    table = StragglerTable(profile_from_dict(random_data(GRAPHS["chain"], 5, draw=30)))
    for name in table.names:
        assert table.factor(name, 3, 1, pp=4) == table.factor(name, 12, 1)
        assert table.factor(name, 3, 1, pp=4) > table.factor(name, 3, 1)


def test_stage_factor_predicts_a_pipelines_pace_under_varying_step_times():
    """One module, pp stages, 1F1B over K steps whose times are i.i.d. from a draw: the
    simulated time over the mean-cost formula is g(1, 1, pp), not h = 1."""
    rng = np.random.default_rng(3)
    draw = rng.lognormal(0, 0.4, 2000)
    data = random_data(GRAPHS["chain"], 0)
    for m in data["modules"].values():
        m["sample_cost_ms"] = draw.tolist()
    table = StragglerTable(profile_from_dict(data))
    k, pp = 240, 4
    y = rng.choice(draw, k)
    stages = np.repeat((y / pp)[:, None], pp, axis=1)
    span = makespan_1f1b(stages / 3, stages * 2 / 3)
    formula = draw.mean() / pp * (k - 1) + draw.mean()
    assert span / formula == pytest.approx(table.factor("llm", 1, 1, pp), rel=0.1)
    assert span / formula > 1.2 * table.factor("llm", 1, 1)  # h alone misses the pace


def test_factors_do_not_depend_on_what_is_computed_alongside():
    profile = profile_from_dict(random_data(GRAPHS["chain"], 2, draw=40))
    alone = [StragglerTable(profile).factor("encoder", dp, 24 // dp, pp) for dp, pp in
             ((2, 1), (3, 2), (4, 4), (12, 3))]
    batch = StragglerTable(profile).factors("encoder", np.array([2, 3, 4, 12, 6, 8]),
                                            np.array([12, 8, 6, 2, 4, 3]),
                                            np.array([1, 2, 4, 3, 1, 2]))
    assert alone == batch[:4].tolist()


def test_constant_draw_has_no_stragglers_and_heavy_tail_has_many():
    data = random_data(GRAPHS["chain"], 4)
    for name, m in data["modules"].items():
        m["sample_cost_ms"] = [3.0] * 20 if name != "generator" else [1.0] * 19 + [40.0]
    table = StragglerTable(profile_from_dict(data))
    assert table.factor("encoder", 8, 1) == pytest.approx(1.0, abs=1e-12)
    assert table.factor("encoder", 4, 4) == pytest.approx(1.0, abs=1e-12)
    assert table.factor("generator", 16, 1) > 3.0  # P(a 40 among 16) ~ 0.56
    assert table.factor("generator", 16, 1) > table.factor("generator", 2, 8)


def test_lpt_rows_with_padded_ranks_equal_the_unpadded_problem():
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0, 1, (3, 12))
    room = np.array([[3, 3, 3, 3, 0, 0], [2] * 6, [6, 6, 0, 0, 0, 0]])
    _, loads = lpt_rows(costs, room)
    for row, r, dp in zip(costs, loads, (4, 6, 2)):
        want = sorted(row[g].sum() for g in lpt_equal_count(row, dp))
        assert sorted(r[:dp]) == want and not r[dp:].any()


# --------------------------------------------------------------------------- search


def test_without_a_draw_the_objective_is_the_mean_cost_formula_float_for_float():
    for seed in range(30):
        profile = profile_from_dict(random_data(GRAPHS["chain"], seed))
        try:
            p = plan(profile)
        except PlanError:
            continue
        d = p.llm.dp * profile.microbatch
        w = {n: samples_per_step(profile, n, d, m.dp) * profile.modules[n].cost_ms[m.tp]
             for n, m in p.modules.items()}
        it = combine(profile.graph, w, {n: w[n] / p.modules[n].pp for n in w}, p.microbatches)
        assert p.t_iter_ms == it.total_ms
        assert all(m.straggler == 1.0 for m in p.modules.values())


@pytest.mark.parametrize("graph, seed", [(g, s) for g in GRAPHS for s in range(12)])
def test_search_with_a_draw_equals_brute_force(graph, seed):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw=24))
    assert outcome(partial(plan, finalists=1), profile) == outcome(exhaustive_plan, profile)


def test_random_draw_instances_are_feasible_and_priced_so_the_comparison_means_something():
    found = [outcome(partial(plan, finalists=1), profile_from_dict(random_data(GRAPHS["chain"], s, draw=24)))
             for s in range(12)]
    feasible = [f for f in found if not isinstance(f, str)]
    assert len(feasible) >= 8
    assert sum(any(h > 1.0 for h in f[1]) for f in feasible) >= 4


# --------------------------------------------------------------------------- payoff


def skewed_profile(draw: bool) -> Profile:
    """An encoder whose samples are mostly light with a heavy tail (1 in 10 costs 20x), an LLM
    and a generator with uniform costs; 48 GPUs, global batch 64."""
    rng = np.random.default_rng(0)
    enc = np.where(rng.random(400) < 0.1, 20.0, 1.0)
    enc_mean = 12.0 * enc / enc.mean()
    mods = {"encoder": {"layers": 8, "cost_ms": {"1": 12.0, "2": 7.0, "4": 4.0}},
            "llm": {"layers": 8, "cost_ms": {"1": 40.0, "2": 22.0, "4": 12.0}},
            "generator": {"layers": 4, "cost_ms": {"1": 6.0, "2": 3.5}}}
    if draw:
        mods["encoder"]["sample_cost_ms"] = enc_mean.tolist()
        mods["llm"]["sample_cost_ms"] = [40.0] * 400
        mods["generator"]["sample_cost_ms"] = [6.0] * 400
    return profile_from_dict({"gpus": 48, "global_batch": 64, "gpus_per_node": 4,
                              "modules": mods})


def test_skewed_draw_changes_the_plan_and_it_simulates_faster():
    mean_plan, draw_plan = plan(skewed_profile(False)), plan(skewed_profile(True))
    assert mean_plan.degrees() != draw_plan.degrees()
    rng = np.random.default_rng(1)  # fresh samples, not the profile's draw
    flops = np.column_stack([np.where(rng.random(64 * 4) < 0.1, 20.0, 1.0),
                             np.ones(64 * 4), np.ones(64 * 4)])
    sims = {}
    for key, p in (("mean", mean_plan), ("draw", draw_plan)):
        times = scale.sample_times(flops, p)
        sims[key] = np.mean([scale.simulate_iteration(times[i * 64:(i + 1) * 64], p, intra=True)
                             .makespan_ms for i in range(4)])
    assert sims["draw"] < 0.95 * sims["mean"]
    # The draw-priced plan predicts its own simulated time far better than the mean-cost one.
    assert abs(sims["draw"] / draw_plan.t_iter_ms - 1) < abs(sims["mean"] / mean_plan.t_iter_ms - 1)


def test_finalists_are_the_closed_forms_best_and_the_fastest_simulated_one_is_chosen(monkeypatch):
    profile = skewed_profile(True)
    table = straggler_table(profile)
    caps = {n: profile.gpus for n in profile.graph.names}
    found = finalists(profile, caps, table, True, 4)
    keys = [t_iter(profile, f, table).total_ms for f in found]
    assert keys == sorted(keys) and len(found) == len({tuple(f.values()) for f in found}) > 1
    assert found[0] == plan(profile, finalists=1).degrees()  # the closed form's best comes first
    # The mean-cost closed form's best layouts join them, then the refined ones (``refine.py``).
    memo: dict = {}
    found += [x for x in finalists(profile, caps, None, True, 4, memo) if x not in found]
    unit = optimize.sim_unit_times(profile)
    refined = refine(profile, found, StepEstimate(profile, unit), memo, optimize.REFINED)
    assert len(refined) == optimize.REFINED
    found += [x for x in refined if x not in found]
    calls = []
    monkeypatch.setattr(optimize, "simulated_ms", lambda *a, **k: calls.append(1) or simulated_ms(*a, **k))
    monkeypatch.setattr(climb, "ROUNDS", 0)  # the descent from the fastest: test_climb.py
    chosen = plan(profile)
    assert chosen.finalists == len(found) and chosen.degrees() in found
    sims = [simulated_ms(profile, build_plan(profile, f, table=table)) for f in found]
    assert chosen.t_sim_ms == min(sims)
    assert 1 <= len(calls) <= len(found)  # those whose lower bound reaches the best time are not simulated
    monkeypatch.undo()
    assert plan(profile).t_sim_ms <= chosen.t_sim_ms  # the descent only ever moves to faster layouts
    # Negative control: a plan from mean costs is never simulated.
    assert plan(skewed_profile(False)).t_sim_ms is None


def test_a_finalist_is_skipped_only_when_its_bound_shows_it_cannot_be_faster(monkeypatch):
    skipped = 0
    for seed in (3, 9, 16, 18):
        profile = profile_from_dict(random_data(GRAPHS["chain"], seed, draw=64))
        table = straggler_table(profile)
        layouts = finalists(profile, {n: profile.gpus for n in profile.graph.names}, table, True, 8)
        plans = [build_plan(profile, x, table=table) for x in layouts]
        assert len(plans) >= 4
        calls = []
        monkeypatch.setattr(optimize, "simulated_ms", lambda *a, **k: calls.append(1) or simulated_ms(*a, **k))
        unit = optimize.sim_unit_times(profile)
        chosen = optimize._fastest_simulated(profile, layouts, unit, table)
        monkeypatch.undo()
        sims = [simulated_ms(profile, p) for p in plans]
        assert chosen.t_sim_ms == min(sims) and chosen.degrees() == plans[sims.index(min(sims))].degrees()
        # The plan returned is the full one: its schedule's prediction and MFU, not the candidate's.
        full = plans[sims.index(min(sims))]
        assert (chosen.t_pred_ms, chosen.mfu) == (full.t_pred_ms, full.mfu)
        skipped += len(plans) - len(calls)
    assert skipped > 0  # the bound does leave some out


# --------------------------------------------------------------------------- paper scale


def test_paper_profile_draw_keeps_each_modules_mean_and_simulation_keeps_the_mean_cost():
    from disttrain_ds.data.paper_stats import draw_sequence_layouts
    from disttrain_ds.paper import load_paper_figures
    paper = load_paper_figures()
    spec, seq = scale.model_specs(paper)["MLLM-72B"], paper["sequence_length"]
    costs = scale.sample_costs(draw_sequence_layouts(40, seq, np.random.default_rng(0)), spec, seq)
    drawn = scale.sample_costs(draw_sequence_layouts(64, seq, np.random.default_rng(1)), spec, seq)
    kw = dict(gpus=spec.ablation_gpus, global_batch=spec.ablation_batch)
    mean_only = scale.build_profile(paper, spec, costs, **kw)
    with_draw = scale.build_profile(paper, spec, costs, draw=drawn, **kw)
    for name, m in with_draw.modules.items():
        assert len(m.sample_cost_ms) == 64
        assert np.mean(m.sample_cost_ms) == pytest.approx(m.cost_ms[1], rel=1e-12)
        assert m.cost_ms == mean_only.modules[name].cost_ms
    p = plan(with_draw)
    assert any(m.straggler > 1.0 for m in p.modules.values())
    times = scale.sample_times(costs.flops, p)  # the straggler factor is not a per-sample cost
    for j, (name, m) in enumerate(p.modules.items()):
        assert times[:, j].mean() == pytest.approx(with_draw.modules[name].cost_ms[m.tp], rel=1e-12)


# ----------------------------------------------------------------------- baselines priced alike


def vlm_profile(draw: bool) -> Profile:
    """An encoder -> LLM model on 8 GPUs at TP=1 (LLM 4x the encoder's cost) whose best
    disaggregated layout is Megatron-LM's (every module at DP 4, one stage each)."""
    rng = np.random.default_rng(3)
    mods = {"vision": {"role": "encoder", "layers": 2, "cost_ms": {"1": 31.0}},
            "llm": {"layers": 4, "cost_ms": {"1": 130.0}}}
    if draw:
        for name, m in mods.items():
            m["sample_cost_ms"] = (m["cost_ms"]["1"] * rng.lognormal(0, 0.5, 16)).tolist()
    return profile_from_dict({"gpus": 8, "global_batch": 16, "microbatch": 1,
                              "gpus_per_node": 1, "modules": mods})


@pytest.mark.parametrize("draw", [False, True])
def test_plan_and_megatron_baseline_price_the_same_layout_the_same(draw):
    profile = vlm_profile(draw)
    found, rigid = plan(profile), megatron_plan(profile, tp=1, pp=1)
    assert found.degrees() == rigid.degrees() == {"vision": (4, 1, 1, 1), "llm": (4, 1, 1, 1)}
    assert rigid.t_iter_ms == found.t_iter_ms
    assert (rigid.t_warmup_ms, rigid.t_steady_ms) == (found.t_warmup_ms, found.t_steady_ms)
    assert [m.straggler for m in rigid.modules.values()] == \
        [m.straggler for m in found.modules.values()]
    if draw:  # the draw is priced (a baseline at the mean cost would look ~1.5x faster)
        assert rigid.t_iter_ms > megatron_plan(vlm_profile(False), tp=1, pp=1).t_iter_ms * 1.1


@pytest.mark.parametrize("graph", ["chain", "two_generators"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("draw", [0, 32])
def test_baselines_are_priced_by_the_objective_of_their_layout(graph, seed, draw):
    profile = profile_from_dict(random_data(GRAPHS[graph], seed, draw))
    table = straggler_table(profile)
    rigid = []
    if graph == "chain":
        for pp in profile.modules["llm"].pp_degrees():
            try:
                rigid.append(megatron_plan(profile, tp=1, pp=pp))
            except PlanError:
                pass
    try:
        rigid.append(ratio_plan(profile))
    except PlanError:
        pass
    for p in rigid:
        assert p.t_iter_ms == t_iter(profile, p.degrees(), table).total_ms
        assert p.t_iter_ms == build_plan(profile, p.degrees(), table=table).t_iter_ms


def test_post_balanced_modules_are_priced_with_their_own_uneven_splits():
    data = random_data(GRAPHS["chain"], 5, draw=256)
    rng = np.random.default_rng(5)
    # A quarter of the samples generate three images, the rest one: a step with one heavy sample is
    # even only if the heavy sample's replica takes fewer samples.
    data["modules"]["generator"]["sample_cost_ms"] = (10.0 * np.where(rng.random(256) < 0.25, 3, 1)).tolist()
    even = StragglerTable(profile_from_dict(data))
    post = StragglerTable(profile_from_dict({**data, "post_balance_share": 2.0}))
    assert 1.0 <= post.factor("generator", 2, 4) < even.factor("generator", 2, 4) - 0.02
    assert post.factor("llm", 2, 4) == even.factor("llm", 2, 4)  # the LLM keeps its blocks
    assert post.factor("generator", 4, 1) == even.factor("generator", 4, 1)  # one sample each: nothing to move
    back = profile_from_dict(profile_to_dict(profile_from_dict({**data, "post_balance_share": 1.5})))
    assert back.post_balance_share == 1.5
    with pytest.raises(ProfileError, match="post_balance_share"):
        profile_from_dict({**data, "post_balance_share": 0.5})


def test_post_balanced_modules_with_unit_draws_split_units_as_the_runtime_does():
    data = random_data(GRAPHS["chain"], 5, draw=256)
    rng = np.random.default_rng(6)
    targets = np.where(rng.random(256) < 0.25, 3, 1) * (rng.random(256) < 0.7)  # 0, 1 or 3 target images
    gen = data["modules"]["generator"]
    gen["sample_cost_ms"] = (10.0 * targets).tolist()
    gen["unit_cost_ms"] = [[10.0] * int(t) for t in targets]
    samples = StragglerTable(profile_from_dict({**data, "post_balance_share": 2.0,
                                                "modules": {**data["modules"], "generator": {
                                                    k: v for k, v in gen.items() if k != "unit_cost_ms"}}}))
    units = StragglerTable(profile_from_dict({**data, "post_balance_share": 2.0}))
    # Equal units: the fullest replica holds ceil(T / dp) of a step's T targets (independent Monte Carlo).
    for dp, m in ((2, 4), (4, 1), (4, 2)):
        t = targets[np.random.default_rng(1).integers(0, 256, (200_000, dp * m))].sum(axis=1)
        want = np.ceil(t / dp).mean() / (t / dp).mean()
        assert units.factor("generator", dp, m) == pytest.approx(want, rel=0.04)
        assert units.factor("generator", dp, m) < samples.factor("generator", dp, m)  # whole samples: worse
    # One sample per replica: whole samples cannot move at all, units can.
    assert units.factor("generator", 4, 1) < samples.factor("generator", 4, 1) - 0.2
    assert units.factor("llm", 2, 4) == samples.factor("llm", 2, 4)
    # Without post-balancing a unit draw changes nothing: replicas take whole samples.
    assert StragglerTable(profile_from_dict(data)).factor("generator", 4, 1) == samples.factor("generator", 4, 1)
    back = profile_from_dict(profile_to_dict(profile_from_dict(data)))
    assert back.modules["generator"].unit_cost_ms == tuple(tuple(u) for u in gen["unit_cost_ms"])


@pytest.mark.parametrize("units,match", [
    ([[10.0]] * 3, r"'modules.generator.unit_cost_ms' needs one list per entry"),
    ("first wrong", r"'modules.generator.unit_cost_ms\[0\]' sums to"),
    ("negative", r"'modules.generator.unit_cost_ms\[0\]\[0\]' must be a finite number >= 0"),
])
def test_a_unit_draw_that_does_not_split_the_sample_draw_is_one_clear_error(units, match):
    data = random_data(GRAPHS["chain"], 5, draw=8)
    gen = data["modules"]["generator"]
    draw = gen["sample_cost_ms"]
    if units == "first wrong":
        units = [[v] for v in draw]
        units[0] = [draw[0] + 1.0]
    elif units == "negative":
        units = [[-1.0, draw[0] + 1.0]] + [[v] for v in draw[1:]]
    gen["unit_cost_ms"] = units
    with pytest.raises(ProfileError, match=match):
        profile_from_dict(data)

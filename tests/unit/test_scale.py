"""disttrain_ds.paper.scale: paper profiles, the iteration simulator, reordering and MFU."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disttrain_ds.cost.profile import Profile
from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.data.paper_stats import draw_sequence_layouts
from disttrain_ds.paper import load_paper_figures, scale
from disttrain_ds.planner.baselines import ratio_plan
from disttrain_ds.planner.optimize import Degrees, PlanError, build_plan, plan, t_iter
from disttrain_ds.schedule.simulate import makespan_1f1b

MODELS = ("MLLM-9B", "MLLM-15B", "MLLM-72B")


@pytest.fixture(scope="module")
def paper() -> dict:
    return load_paper_figures()


@pytest.fixture(scope="module")
def cases(paper) -> dict:
    """Per model: (spec, one global batch of priced samples, profile at paper scale, plans)."""
    specs = scale.model_specs(paper)
    seq, bs = paper["sequence_length"], paper["megatron_baseline_layout"]["global_batch"]
    layouts = draw_sequence_layouts(bs, seq, np.random.default_rng(0))
    out = {}
    for name, spec in specs.items():
        costs = scale.sample_costs(layouts, spec, seq)
        prof = scale.build_profile(paper, spec, costs, gpus=spec.scale_gpus, global_batch=bs)
        out[name] = (spec, costs, prof, scale.paper_plans(prof, spec))
    return out


@pytest.fixture(scope="module")
def evaluated(paper) -> dict:
    """PlanResult of every plan of every model at the paper's Fig. 17 scale (96 GPUs, global
    batch 128 / 64 / 40), all four reordering variants, one iteration."""
    specs = scale.model_specs(paper)
    seq = paper["sequence_length"]
    layouts = draw_sequence_layouts(max(s.ablation_batch for s in specs.values()), seq,
                                    np.random.default_rng(1))
    out = {}
    for name, spec in specs.items():
        costs = scale.sample_costs(layouts[:spec.ablation_batch], spec, seq)
        prof = scale.build_profile(paper, spec, costs, gpus=spec.ablation_gpus,
                                   global_batch=spec.ablation_batch)
        for key, p in scale.paper_plans(prof, spec).items():
            out[(name, key)] = scale.evaluate_plan(p, prof, costs, iterations=1, seq_len=seq,
                                                   budget_s=0.02)
    return out


def tiny_profile(enc: float, llm: float, gen: float, *, gpus: int = 64, batch: int = 8,
                 layers: int = 4) -> Profile:
    """Three modules with TP=1 costs only and ``layers`` layers each."""
    mods = {n: {"layers": layers, "cost_ms": {"1": c}}
            for n, c in (("encoder", enc), ("llm", llm), ("generator", gen))}
    return profile_from_dict({"gpus": gpus, "global_batch": batch, "peak_tflops": 312,
                              "modules": mods})


def uniform_times(p) -> np.ndarray:
    return scale.sample_times(np.ones((p.microbatches * p.llm.dp, 3)), p)


# ----------------------------------------------------------------------- profiles


def test_profiles_use_the_papers_gpu_counts_batch_and_figures(paper, cases):
    assert sorted(cases) == sorted(MODELS)
    overall = {r["model"]: r for r in paper["overall_fig15_16"]}
    mega = paper["megatron_baseline_layout"]
    for name, (spec, _, prof, plans) in cases.items():
        assert prof.gpus == max(overall[name]["megatron"]["gpus"],
                                overall[name]["disttrain"]["gpus"])
        assert prof.global_batch == mega["global_batch"] == 1920
        m = plans["megatron"]
        assert (m.llm.tp, m.llm.pp) == (mega["tp"], mega["pp_llm"][name])
        assert m.gpus == m.llm.dp * mega["tp"] * (mega["pp_llm"][name] + 2)
        assert all(p.gpus <= prof.gpus for p in plans.values())
        assert all(prof.modules[n].flops_per_sample > 0 for n in scale.MODULES)
    # Fig. 3 profiles one Llama3-70B stage at TP=8, PP=10; fwd + 2 x fwd per stage, 10 stages.
    llm72 = cases["MLLM-72B"][2].modules["llm"].cost_ms
    assert llm72[8] == pytest.approx(3 * 93.8 * 10, rel=1e-12)
    assert llm72[1] == pytest.approx(llm72[8] * 8 * 0.9 ** 3, rel=1e-12)
    c = [cases[n][2].modules["llm"].cost_ms[8] for n in MODELS]
    assert c[0] < c[1] < c[2]


def test_fig3_times_interpolate_in_images_per_sequence(paper):
    fig3 = paper["forward_ms_profile_fig3"]
    assert scale.fig3_forward_ms(paper, 512, 8) == fig3["8img_512"]
    at16 = scale.fig3_forward_ms(paper, 1024, 16)["sd21"]
    assert at16 == pytest.approx(fig3["16img_1024"]["sd21"])
    mid = scale.fig3_forward_ms(paper, 512, 12)["vit_huge"]
    assert mid == pytest.approx((fig3["8img_512"]["vit_huge"] + fig3["16img_512"]["vit_huge"]) / 2)
    with pytest.raises(ValueError, match="resolution 768"):
        scale.fig3_forward_ms(paper, 768, 8)


def test_sample_times_keep_the_profile_mean_and_the_flops_variation(cases):
    _, costs, _, plans = cases["MLLM-15B"]
    p = plans["ours"]
    times = scale.sample_times(costs.flops, p)
    for j, n in enumerate(scale.MODULES):
        mod = p.module(n)
        assert times[:, j].mean() == pytest.approx(mod.warmup_ms / mod.samples_per_microbatch)
        ratio = times[:, j] / costs.flops[:, j]
        assert np.allclose(ratio, ratio[0])


# ----------------------------------------------------------------------- simulator vs formula


@pytest.mark.parametrize("layout", [
    {"encoder": Degrees(1, 1, 1), "llm": Degrees(4, 1, 2), "generator": Degrees(2, 1, 1)},
    {"encoder": Degrees(2, 1, 2), "llm": Degrees(2, 1, 4), "generator": Degrees(1, 1, 1)},
    {"encoder": Degrees(4, 1, 1), "llm": Degrees(4, 1, 1), "generator": Degrees(4, 1, 2)},
])
def test_uniform_costs_reproduce_t_iter_when_the_last_stage_is_the_slowest(layout):
    # 1F1B with backward = 2 x forward takes sum(stages) + max(stage) * (K - 1) exactly when
    # the slowest stage is the last one (the generator's), whatever the other stages are.
    prof = tiny_profile(enc=7.0, llm=20.0, gen=45.0)
    p = build_plan(prof, layout)
    stages = [p.module(n).stage_ms for n in scale.MODULES]
    assert stages[2] == max(stages) and p.microbatches > 1
    sim = scale.simulate_iteration(uniform_times(p), p).makespan_ms
    assert sim == pytest.approx(t_iter(prof, layout).total_ms, rel=1e-12)


def test_formula_is_an_upper_bound_that_is_tight_only_at_the_last_stage_or_one_step():
    prof = tiny_profile(enc=60.0, llm=20.0, gen=10.0)
    layout = {"encoder": Degrees(1, 1, 1), "llm": Degrees(2, 1, 2), "generator": Degrees(1, 1, 1)}
    p = build_plan(prof, layout)
    sim = scale.simulate_iteration(uniform_times(p), p).makespan_ms
    assert sim < t_iter(prof, layout).total_ms * (1 - 1e-3)  # slowest stage first: slack
    one = tiny_profile(enc=60.0, llm=20.0, gen=10.0, batch=2)
    p1 = build_plan(one, layout)  # D = 2 = batch: one step, no steady state
    assert p1.microbatches == 1
    assert scale.simulate_iteration(uniform_times(p1), p1).makespan_ms == pytest.approx(
        t_iter(one, layout).total_ms, rel=1e-12)


def test_megatron_72b_is_generator_bound_so_simulation_equals_its_formula(cases):
    p = cases["MLLM-72B"][3]["megatron"]
    assert p.module("generator").stage_ms > max(p.module("encoder").stage_ms, p.llm.stage_ms)
    sim = scale.simulate_iteration(uniform_times(p), p).makespan_ms
    assert sim == pytest.approx(p.t_iter_ms, rel=1e-9)


# ----------------------------------------------------------------------- plans and reordering


def test_ours_is_never_slower_than_the_baselines_under_the_same_simulator(evaluated):
    for name in MODELS:
        ours = evaluated[(name, "ours")]
        for other in ("megatron", "ratio", "flops"):
            for v in scale.VARIANTS:
                assert ours.t_ms[v] <= evaluated[(name, other)].t_ms[v], (name, other, v)


def test_ours_is_never_slower_at_the_papers_full_scale(cases, paper):
    # The FLOP split's 72B pipeline (hundreds of steps x ~90 stages) is left to the bench.
    for name, (_, costs, prof, plans) in cases.items():
        ours = scale.evaluate_plan(plans["ours"], prof, costs, iterations=1,
                                   seq_len=paper["sequence_length"], variants=("none", "both"),
                                   budget_s=0.05)
        for other in ("megatron", "ratio"):
            r = scale.evaluate_plan(plans[other], prof, costs, iterations=1,
                                    seq_len=paper["sequence_length"], variants=("none", "both"),
                                    budget_s=0.05)
            assert ours.t_ms["none"] <= r.t_ms["none"] and ours.t_ms["both"] <= r.t_ms["both"]


def test_reordering_never_slows_the_fig17_scale_iterations(evaluated):
    for key, r in evaluated.items():
        assert r.t_ms["intra"] <= r.t_ms["none"], key
        assert r.t_ms["inter"] <= r.t_ms["none"], key
        assert r.t_ms["both"] <= r.t_ms["intra"], key
    gains = [r.t_ms["none"] / r.t_ms["both"] for r in evaluated.values()]
    assert max(gains) > 1.01  # reordering is not a no-op on the paper's models


def test_reordering_never_slows_random_instances():
    rng = np.random.default_rng(3)
    checked = 0
    for seed in range(16):
        r = random.Random(seed)
        bs = r.choice([8, 12, 16, 24])
        prof = tiny_profile(r.uniform(5, 80), r.uniform(5, 80), r.uniform(5, 80),
                            gpus=r.randint(6, 40), batch=bs, layers=r.choice([1, 2, 4]))
        try:
            plans = [plan(prof), ratio_plan(prof)]
        except PlanError:
            continue
        flops = rng.lognormal(0.0, r.uniform(0.2, 1.2), size=(bs, 3))
        for p in plans:
            times = scale.sample_times(flops, p)
            t = {v: scale.simulate_iteration(times, p, intra=a, inter=b,
                                             budget_s=0.02).makespan_ms
                 for v, (a, b) in scale.VARIANTS.items()}
            assert t["intra"] <= t["none"] and t["inter"] <= t["none"]
            assert t["both"] <= t["intra"]
            checked += 1
    assert checked >= 12


def test_intra_reordering_balances_a_step_and_keeps_samples_in_their_step():
    prof = tiny_profile(enc=100.0, llm=10.0, gen=10.0, batch=8)
    layout = {"encoder": Degrees(2, 1, 1), "llm": Degrees(4, 1, 1), "generator": Degrees(4, 1, 1)}
    p = build_plan(prof, layout)  # D = 4, K = 2; each encoder replica takes 2 samples per step
    flops = np.ones((8, 3))
    flops[:, 0] = [9, 9, 1, 1, 1, 1, 9, 9]  # loader order piles the heavy ones together
    times = scale.sample_times(flops, p)
    arr = scale.balance_steps(times, p)
    assert sorted(arr[:4]) == [0, 1, 2, 3] and sorted(arr[4:]) == [4, 5, 6, 7]
    before = scale.replica_max(times.reshape(2, 4, 3), p)[:, 0]
    after = scale.replica_max(times[arr].reshape(2, 4, 3), p)[:, 0]
    assert np.allclose(after, before * 10 / 18)  # {9, 9} | {1, 1} -> {9, 1} | {9, 1}
    none = scale.simulate_iteration(times, p, lock_step=True).makespan_ms
    assert scale.simulate_iteration(times, p, intra=True, lock_step=True).makespan_ms < 0.7 * none
    # The runtime's two replica groups (encoder replica r with its LLM and generator replicas)
    # never wait for each other: each takes one heavy and one light step, as balanced.
    assert scale.simulate_iteration(times, p).makespan_ms == pytest.approx(
        scale.simulate_iteration(times, p, intra=True).makespan_ms, rel=1e-12)


def test_lock_step_replicas_are_never_faster_than_the_runtimes_coupling(cases):
    for key in ("megatron", "ratio", "ours"):
        _, costs, _, plans = cases["MLLM-9B"]
        p = plans[key]
        times = scale.sample_times(costs.flops, p)
        coupled = scale.simulate_iteration(times, p).makespan_ms
        assert coupled <= scale.simulate_iteration(times, p, lock_step=True).makespan_ms
    one = build_plan(tiny_profile(30.0, 60.0, 90.0, batch=4),
                     {n: Degrees(1, 1, 1) for n in scale.MODULES})
    t1 = scale.sample_times(np.arange(1.0, 13.0).reshape(4, 3), one)
    assert scale.simulate_iteration(t1, one).makespan_ms == \
        scale.simulate_iteration(t1, one, lock_step=True).makespan_ms  # one replica: the same


def _two_replica_plan(enc_dp: int, gen_dp: int):
    """LLM DP 2, one sample per replica per step, two steps; every module one stage."""
    layout = {"encoder": Degrees(enc_dp, 1, 1), "llm": Degrees(2, 1, 1),
              "generator": Degrees(gen_dp, 1, 1)}
    return build_plan(tiny_profile(3.0, 30.0, 3.0, batch=4), layout)


def test_replicas_meet_only_at_boundaries_so_a_slow_microbatch_evens_out():
    # The runtime's DP replicas of a module share no per-microbatch collective (gradients are
    # all-reduced after the last microbatch) and exchange samples only with the boundary
    # replicas that own them (comm.routes). With every module at DP 2 the two replicas never
    # meet: replica 0 slow in step 0 and fast in step 1, replica 1 the reverse, takes the
    # slowest replica's own pipeline, not a pipeline paced by the slowest of each step.
    p = _two_replica_plan(2, 2)
    assert scale.replica_groups(p) == 2
    llm = np.array([90.0, 10.0, 10.0, 90.0])  # slots: step 0 (replica 0, 1), step 1 (0, 1)
    times = np.stack([np.full(4, 3.0), llm, np.full(4, 3.0)], axis=1)
    coupled = scale.simulate_iteration(times, p).makespan_ms
    own = [makespan_1f1b(*scale.split_fwd_bwd(np.array([[3.0, a, 3.0], [3.0, b, 3.0]])))
           for a, b in ((90.0, 10.0), (10.0, 90.0))]
    assert coupled == pytest.approx(max(own), rel=1e-12)
    lock = scale.simulate_iteration(times, p, lock_step=True).makespan_ms
    assert lock == pytest.approx(makespan_1f1b(*scale.split_fwd_bwd(
        np.array([[3.0, 90.0, 3.0], [3.0, 90.0, 3.0]]))), rel=1e-12)
    assert coupled < lock * 0.7


def test_a_shared_boundary_replica_couples_the_replicas_it_feeds():
    # One encoder replica feeds both LLM replicas (fan-out): one group; the encoder's backward
    # waits for both LLM replicas' gradients, so the slow replica holds the fast one back.
    p = _two_replica_plan(1, 2)
    assert scale.replica_groups(p) == 1
    llm = np.array([90.0, 10.0, 10.0, 90.0])
    times = np.stack([np.full(4, 3.0), llm, np.full(4, 3.0)], axis=1)
    coupled = scale.simulate_iteration(times, p).makespan_ms
    apart = scale.simulate_iteration(times, _two_replica_plan(2, 2)).makespan_ms
    lock = scale.simulate_iteration(times, p, lock_step=True).makespan_ms
    assert apart < coupled <= lock
    # the group's replica-stage DAG: encoder -> both LLM replicas -> their own generator
    stages = scale.group_stage_times(times, p, np.arange(4))
    assert stages.shape == (1, 2, 5)
    assert stages[0, 0].tolist() == [6.0, 90.0, 10.0, 3.0, 3.0]


# ----------------------------------------------------------------------- MFU


def test_mfu_and_throughput_on_a_hand_made_iteration():
    half = scale.mfu(312e12 * 4 * 2 * 0.5, gpus=4, t_ms=2000.0, peak_tflops=312)
    assert half == pytest.approx(0.5)
    # One GPU per module, two samples, one sample per step: stages 30 / 60 / 90 ms, the last
    # slowest, so the iteration takes (30 + 60 + 90) + 90 * (2 - 1) = 270 ms.
    prof = tiny_profile(enc=30.0, llm=60.0, gen=90.0, gpus=3, batch=2, layers=1)
    p = build_plan(prof, {n: Degrees(1, 1, 1) for n in scale.MODULES})
    flops = np.array([[1e12, 4e12, 2e12]] * 2)  # forward; training = 3 x forward
    costs = scale.SampleCosts((), flops, np.array([1, 1]))
    r = scale.evaluate_plan(p, prof, costs, iterations=1, seq_len=8192, variants=("none",))
    assert r.t_ms["none"] == pytest.approx(270.0)
    assert r.mfu["none"] == pytest.approx(2 * 3 * 7e12 / (3 * 312e12 * 0.270))
    assert r.tokens_per_s["none"] == pytest.approx(2 * 8192 / 0.270)


# ----------------------------------------------------------------------- module graphs

STAR = {"a": "encoder", "b": "encoder", "llm": "llm", "x": "generator", "y": "generator"}


def star_profile(costs: dict[str, float], *, gpus: int = 64, batch: int = 8,
                 layers: int = 4) -> Profile:
    """Two encoders, the LLM and two generators, TP=1 costs only."""
    mods = {n: {"role": STAR[n], "layers": layers, "cost_ms": {"1": c}} for n, c in costs.items()}
    return profile_from_dict({"gpus": gpus, "global_batch": batch, "peak_tflops": 312,
                              "modules": mods})


def test_uniform_costs_on_a_star_reproduce_t_iter_when_a_generator_is_slowest():
    prof = star_profile({"a": 7.0, "b": 11.0, "llm": 20.0, "x": 9.0, "y": 45.0})
    layout = {"a": Degrees(1, 1, 1), "b": Degrees(2, 1, 2), "llm": Degrees(4, 1, 2),
              "x": Degrees(4, 1, 2), "y": Degrees(2, 1, 1)}
    p = build_plan(prof, layout)
    assert max(m.stage_ms for m in p.modules.values()) == p.module("y").stage_ms
    times = scale.sample_times(np.ones((p.microbatches * p.llm.dp, 5)), p)
    assert times.shape == (8, 5)
    sim = scale.simulate_iteration(times, p)
    assert sim.stage_ms.shape == (p.microbatches, 8)
    assert sim.makespan_ms == pytest.approx(t_iter(prof, layout).total_ms, rel=1e-12)


def test_reordering_never_slows_random_star_plans():
    rng = np.random.default_rng(4)
    checked = 0
    for seed in range(8):
        r = random.Random(seed)
        bs = r.choice([8, 12, 16])
        prof = star_profile({n: r.uniform(5, 80) for n in STAR}, gpus=r.randint(10, 40), batch=bs,
                            layers=r.choice([1, 2, 4]))
        try:
            p = plan(prof)
        except PlanError:
            continue
        times = scale.sample_times(rng.lognormal(0.0, r.uniform(0.2, 1.2), size=(bs, 5)), p)
        t = {v: scale.simulate_iteration(times, p, intra=a, inter=b, budget_s=0.02).makespan_ms
             for v, (a, b) in scale.VARIANTS.items()}
        assert t["intra"] <= t["none"] and t["inter"] <= t["none"] and t["both"] <= t["intra"]
        assert scale.straggler_factors(times, p).shape == (5,)
        checked += 1
    assert checked >= 5


def test_coupled_replicas_on_a_star_are_never_slower_than_lock_step():
    prof = star_profile({"a": 30.0, "b": 20.0, "llm": 60.0, "x": 90.0, "y": 10.0}, batch=4)
    for dps in ({n: 2 for n in STAR}, {"a": 1, "b": 2, "llm": 2, "x": 2, "y": 1}):
        p = build_plan(prof, {n: Degrees(dps[n], 1, 1) for n in STAR})
        times = scale.sample_times(np.arange(1.0, 21.0).reshape(4, 5), p)
        assert scale.simulate_iteration(times, p).makespan_ms <= \
            scale.simulate_iteration(times, p, lock_step=True).makespan_ms

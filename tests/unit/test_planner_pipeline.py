"""The planner's predicted time: the runtime's 1F1B schedule over the plan's stage times."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.paper import scale
from disttrain_ds.planner.optimize import Degrees, PlanError, build_plan, plan
from disttrain_ds.planner.pipeline import hidden_ms, predict, schedule_ms, split_fwd_bwd
from disttrain_ds.schedule.simulate import makespan_1f1b, stage_order


def tiny_profile(enc: float, llm: float, gen: float, *, gpus: int = 64, batch: int = 8,
                 layers: int = 4):
    mods = {n: {"layers": layers, "cost_ms": {"1": c}}
            for n, c in (("encoder", enc), ("llm", llm), ("generator", gen))}
    return profile_from_dict({"gpus": gpus, "global_batch": batch, "peak_tflops": 312,
                              "modules": mods})


def test_simulated_op_order_is_deepspeeds_train_schedule():
    # The runtime asks DeepSpeed's TrainSchedule for every global stage (schedule/onef1b.py);
    # the simulator the planner prices with must run the same forward/backward order.
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for m, p in ((4, 3), (2, 5), (7, 4), (1, 3)):
        for s in range(p):
            ops = [c for cmds in ds.TrainSchedule(micro_batches=m, stages=p, stage_id=s)
                   for c in cmds if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
            kinds = [int(isinstance(c, ds.BackwardPass)) for c in ops]
            assert kinds == [k for k, _ in stage_order(m, p, s)], (m, p, s)


def test_the_llm_bottleneck_hides_the_generators_round_trip():
    # Three one-stage modules, LLM slowest, K = 4 (MLLM-15B's shape at the paper's scale): the
    # LLM's second forward runs while microbatch 0 makes its generator round trip, so the
    # schedule takes one LLM forward less than the closed form's critical path + steady state.
    prof = tiny_profile(enc=30.0, llm=180.0, gen=90.0, batch=8)
    layout = {n: Degrees(2, 1, 1) for n in ("encoder", "llm", "generator")}
    p = build_plan(prof, layout)
    assert p.microbatches == 4
    assert p.t_iter_ms == pytest.approx(30 + 180 + 90 + 180 * 3)
    assert p.t_pred_ms == pytest.approx(p.t_iter_ms - 180 / 3)
    fwd, bwd = split_fwd_bwd(np.tile([30.0, 180.0, 90.0], (4, 1)))
    assert p.t_pred_ms == pytest.approx(makespan_1f1b(fwd, bwd), rel=1e-12)
    assert p.mfu is None or p.mfu > 0


def test_prediction_is_the_simulated_iteration_for_uniform_samples():
    # Without per-sample draws the prediction is the simulator's makespan on mean-cost samples,
    # for every layout, and never above the closed form the search minimises.
    rng = random.Random(3)
    checked = 0
    for _ in range(40):
        prof = tiny_profile(rng.uniform(5, 90), rng.uniform(5, 90), rng.uniform(5, 90),
                            gpus=rng.randint(3, 24), batch=rng.choice([4, 8, 12, 16]),
                            layers=rng.choice([1, 2, 4]))
        try:
            p = plan(prof)
        except PlanError:
            continue
        times = scale.sample_times(np.ones((p.microbatches * p.llm.dp, 3)), p)
        sim = scale.simulate_iteration(times, p).makespan_ms
        assert p.t_pred_ms == pytest.approx(sim, rel=1e-9)
        assert p.t_pred_ms <= p.t_iter_ms * (1 + 1e-12)
        checked += 1
    assert checked >= 20


def test_hidden_part_is_zero_when_the_last_stage_is_slowest_and_bounded_by_what_follows():
    graph = tiny_profile(1, 1, 1).graph
    pp = {"encoder": 1, "llm": 2, "generator": 1}
    slow_last = {"encoder": 5.0, "llm": 10.0, "generator": 30.0}
    assert hidden_ms(graph, pp, slow_last, 6) == pytest.approx(0.0, abs=1e-9)
    slow_first = {"encoder": 40.0, "llm": 10.0, "generator": 7.0}
    hidden = hidden_ms(graph, pp, slow_first, 6)
    assert 0 < hidden <= (2 * 10.0 + 7.0) * (1 + 1e-12)  # at most the stages after the bottleneck
    assert predict(graph, pp, 500.0, slow_first, 6) == pytest.approx(500.0 - hidden)
    assert schedule_ms(graph, pp, slow_first, 1) == pytest.approx(40 + 20 + 7)


def test_sweeps_give_the_op_by_op_simulators_makespan_on_random_dags():
    from disttrain_ds.schedule.simulate import chain_preds, makespan_dag
    from disttrain_ds.schedule.sweep import makespans
    rng = np.random.default_rng(5)
    for t in range(60):
        p, k = int(rng.integers(1, 8)), int(rng.integers(1, 10))
        preds = chain_preds(p) if t % 2 else tuple(
            tuple(sorted({int(u) for u in rng.integers(0, s, 2)})) if s and rng.random() < 0.8
            else () for s in range(p))
        f = rng.lognormal(0, 1, (3, k, p))
        b = f * rng.uniform(0.5, 3, (3, k, p))
        got = makespans(f, b, preds)
        assert got.shape == (3,)
        for g in range(3):
            assert got[g] == pytest.approx(makespan_dag(f[g], b[g], preds), rel=1e-12)

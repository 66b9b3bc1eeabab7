"""Emulated compute: per-op costs from the cost model and a profile, stage tables, the simulator
with measured overheads, the wait itself, and the recipe checks."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime import emulate
from disttrain_ds.runtime.emulate import Emulator
from disttrain_ds.schedule import replay
from disttrain_ds.schedule.replay import Overheads, RankCosts
from disttrain_ds.schedule.simulate import makespan_1f1b

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"
DISAGG = ["layout=disaggregated"]


def _profile(tmp_path: Path, costs=(60.0, 200.0, 120.0), tps=("1",)) -> Path:
    mods = {m: {"layers": 2, "cost_ms": {t: c / int(t) for t in tps}} for m, c in zip(("encoder", "llm", "generator"), costs)}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"gpus": 4, "global_batch": 4, "modules": mods}))
    return path


# --------------------------------------------------------------------------- pure cost functions


def test_mean_sample_costs_the_profiled_time_times_scale_split_one_to_two():
    rate = emulate.ms_per_flop_from_profile(cost_ms=90.0, mean_fwd_flops=3e6, time_scale=0.5)
    fwd, bwd = emulate.microbatch_ms([3e6], rate, pp=1)
    assert fwd + bwd == pytest.approx(45.0)
    assert bwd == pytest.approx(2 * fwd)


def test_stage_share_is_replica_samples_over_pp():
    rate = emulate.ms_per_flop_from_profile(90.0, 1e6, 1.0)
    whole = emulate.microbatch_ms([1e6, 3e6], rate, pp=1)
    quarter = emulate.microbatch_ms([1e6, 3e6], rate, pp=4)
    assert whole[0] == pytest.approx(4 * quarter[0]) == pytest.approx(4 * 30.0)  # 4 mean samples' forward
    with pytest.raises(ValueError, match="pp"):
        emulate.microbatch_ms([1.0], rate, pp=0)


def test_heavier_samples_wait_proportionally_longer():
    rate = emulate.ms_per_flop_from_profile(30.0, 2e6, 1.0)
    light, heavy = emulate.microbatch_ms([1e6], rate, 1), emulate.microbatch_ms([5e6], rate, 1)
    assert heavy[0] == pytest.approx(5 * light[0])


def test_module_without_work_costs_nothing():
    assert emulate.ms_per_flop_from_profile(100.0, 0.0, 1.0) == 0.0


def test_tflops_rate_divides_work_over_tp():
    one = emulate.ms_per_flop_from_tflops(1.0, tp=1, time_scale=1.0)
    assert emulate.microbatch_ms([1e12], one, 1)[0] == pytest.approx(1000.0)
    assert emulate.ms_per_flop_from_tflops(1.0, tp=4, time_scale=2.0) == pytest.approx(one / 2)
    with pytest.raises(ValueError, match="tflops"):
        emulate.ms_per_flop_from_tflops(0.0, 1, 1.0)


def _rc(rank, stage, dp, fwd, bwd=None, module="llm", prep=0.0) -> RankCosts:
    return RankCosts(rank, module, stage, dp, tuple(fwd), tuple(bwd if bwd is not None else [2 * f for f in fwd]), prep)


def test_stage_tables_take_the_slowest_replica_per_microbatch():
    ranks = [_rc(0, 0, 0, [10, 1]), _rc(1, 0, 1, [2, 7]), _rc(2, 1, 0, [5, 5])]
    fwd, bwd = replay.stage_tables(ranks, 2)
    assert fwd.tolist() == [[10, 5], [7, 5]]
    assert bwd.tolist() == [[20, 10], [14, 10]]


def test_stage_tables_refuse_missing_stages_and_ragged_steps():
    with pytest.raises(ValueError, match="stages"):
        replay.stage_tables([_rc(0, 0, 0, [1, 1])], 2)
    with pytest.raises(ValueError, match="microbatches"):
        replay.stage_tables([_rc(0, 0, 0, [1, 1]), _rc(1, 1, 0, [1])], 2)


def test_simulate_step_without_overheads_is_the_planner_simulator():
    ranks = [_rc(0, 0, 0, [3, 1, 2]), _rc(1, 1, 0, [2, 2, 2]), _rc(2, 2, 0, [1, 4, 1])]
    fwd, bwd = replay.stage_tables(ranks, 3)
    t, _ = replay.simulate_step(ranks, 3)
    assert t == pytest.approx(makespan_1f1b(fwd, bwd))


def test_overheads_lengthen_ops_crossings_head_and_tail():
    ranks = [_rc(0, 0, 0, [3, 1]), _rc(1, 1, 0, [2, 2])]
    base, _ = replay.simulate_step(ranks, 2)
    fwd, bwd = replay.stage_tables(ranks, 2)
    with_ops, _ = replay.simulate_step(ranks, 2, Overheads(op_ms=0.5, comm_ms=0.25))
    assert with_ops == pytest.approx(makespan_1f1b(fwd + 0.5, bwd + 0.5, comm=0.25))
    assert with_ops > base
    ranks = [_rc(0, 0, 0, [3, 1], prep=4.0), _rc(1, 1, 0, [2, 2], prep=1.0)]
    shifted, _ = replay.simulate_step(ranks, 2, Overheads(tail_ms=(3.0, 100.0), prep=True))
    # stage 1 ends before stage 0 (its last backward feeds stage 0's), so its long tail decides
    assert shifted == pytest.approx(4.0 + 100.0 + max(e.end for e in replay.simulate_step(ranks, 2)[1].events if e.stage == 1))
    assert replay.simulate_ranks(ranks, 1, Overheads(tail_ms=(3.0, 100.0), prep=True))[0] == pytest.approx(shifted)
    with pytest.raises(ValueError, match="tail_ms"):
        replay.simulate_step(ranks, 2, Overheads(tail_ms=(1.0,)))


def _span(name, mb, start, end):
    return {"name": name, "mb": mb, "start": start, "end": end}


def test_measure_overheads_from_a_constructed_two_stage_trace():
    # One microbatch: stage 0 forward 10 ms, stage 1 receives 1.5 ms after it, forward 10, backward 20,
    # gradient back 1.0 ms after, stage 0 backward 20; each op overruns its emulated time by 0.5 ms.
    ranks = [_rc(0, 0, 0, [10.0], [20.0], "encoder", prep=4.0), _rc(1, 1, 0, [10.0], [20.0])]
    spans = {
        0: [_span("load", 0, 0.0, 0.0), _span("forward", 0, 0.0, 10.5), _span("recv", 0, 10.5, 43.5),
            _span("backward", 0, 43.5, 64.0), _span("allreduce", None, 64.0, 66.0), _span("optimizer", None, 66.0, 67.0)],
        1: [_span("recv", 0, 0.0, 12.0), _span("load", 0, 12.0, 12.0), _span("forward", 0, 12.0, 22.5),
            _span("backward", 0, 22.5, 43.0), _span("optimizer", None, 43.0, 51.0)],
    }
    ov = replay.measure_overheads(spans, ranks, slot=1)
    assert ov.op_ms == pytest.approx(0.5)
    assert ov.comm_ms == pytest.approx(np.median([12.0 - 10.5, 43.5 - 43.0]))
    assert ov.prep
    assert ov.tail_ms == pytest.approx((3.0, 8.0))
    t, _ = replay.simulate_step(ranks, 2, ov)
    assert t == pytest.approx(4.0 + 67.0, abs=0.01)  # the trace's own end (67 ms) after the head
    assert replay.simulate_ranks(ranks, 1, ov)[0] == pytest.approx(t)


def test_measured_costs_replay_a_trace_whose_ops_ran_over_their_emulated_times():
    # The trace above, but stage 1's forward lost its core for 7 ms and its send took 0.5 ms.
    ranks = [_rc(0, 0, 0, [10.0], [20.0], "encoder"), _rc(1, 1, 0, [10.0], [20.0])]
    spans = {
        0: [_span("load", 0, 0.0, 1.0), _span("forward", 0, 1.0, 11.0), _span("recv", 0, 11.0, 50.0),
            _span("backward", 0, 50.0, 70.0), _span("optimizer", None, 70.0, 71.0)],
        1: [_span("recv", 0, 0.0, 12.0), _span("forward", 0, 12.0, 29.0), _span("backward", 0, 29.0, 49.0),
            _span("send", 0, 49.0, 49.5), _span("optimizer", None, 49.5, 51.0)],
    }
    ran = replay.measured_costs(spans, ranks)
    assert [(r.fwd_ms, r.bwd_ms) for r in ran] == [((11.0,), (20.0,)), ((17.0,), (20.5,))]
    assert replay.crossing_latencies(spans, ranks, slot=1) == pytest.approx([12.0 - 11.0, 50.0 - 49.0])
    ov = dataclasses.replace(replay.measure_overheads(spans, ranks, slot=1), op_ms=0.0, prep=False)
    replayed, _ = replay.simulate_ranks(ran, 1, ov)
    # the trace's own end, plus the send once more: the crossing is timed from the backward's end
    assert replayed == pytest.approx(71.0 + 0.5)
    emulated, _ = replay.simulate_ranks(ranks, 1, ov)
    assert emulated == pytest.approx(71.0 - 7.0 - 1.0)  # the emulated times miss the overrun and the load


def test_measured_costs_keep_zero_backward_for_a_module_without_backward():
    ranks = [_rc(0, 0, 0, [5.0, 5.0], [0.0, 0.0], "encoder")]
    spans = {0: [_span("forward", 0, 0.0, 6.0), _span("send", 0, 6.0, 7.0), _span("forward", 1, 7.0, 12.0)]}
    ran = replay.measured_costs(spans, ranks)
    assert ran[0].fwd_ms == (7.0, 5.0) and ran[0].bwd_ms == (0.0, 0.0)


def test_tail_is_taken_from_the_replica_that_did_not_wait_in_the_all_reduce():
    ranks = [_rc(0, 0, 0, [10.0], [20.0]), _rc(1, 0, 1, [10.0], [20.0])]
    spans = {0: [_span("forward", 0, 0, 10), _span("backward", 0, 10, 30), _span("allreduce", None, 30, 52)],
             1: [_span("forward", 0, 0, 10), _span("backward", 0, 10, 50), _span("allreduce", None, 50, 52)]}
    assert replay.measure_overheads(spans, ranks, slot=2).tail_ms == (2.0,)


def test_links_follow_replicas_inside_a_module_and_dp_blocks_across_modules():
    # encoder dp 1 -> llm dp 2 (one stage) -> generator dp 1, slot of 2 samples
    ranks = [_rc(0, 0, 0, [1], module="encoder"), _rc(1, 1, 0, [1]), _rc(2, 1, 1, [1]),
             _rc(3, 2, 0, [1], module="generator")]
    d = replay.links(ranks, slot=2)
    assert d[(1, replay.FWD, 0)] == [0] and d[(0, replay.BWD, 0)] == [1, 2] and d[(3, replay.FWD, 0)] == [1, 2]
    # inside a module (llm pp 2, dp 2): only the same replica
    ranks = [_rc(0, 0, 0, [1]), _rc(1, 0, 1, [1]), _rc(2, 1, 0, [1]), _rc(3, 1, 1, [1])]
    assert replay.links(ranks, slot=2)[(3, replay.FWD, 0)] == [1]


def test_post_balanced_links_change_with_each_microbatchs_placement():
    # encoder dp 2 -> llm dp 2 (one stage): blocks would pair replica r with r; post-balancing
    # recorded other peers per microbatch (microbatch 1: encoder replica 1 held no image).
    peers = {0: {"llm": ((0,), (0, 1))}, 1: {"llm": ((0, 1), ())}}
    ranks = [replace(_rc(r, 0, r, [1, 1], module="encoder"), peers=peers[r]) for r in (0, 1)]
    ranks += [_rc(2, 1, 0, [1, 1]), _rc(3, 1, 1, [1, 1])]
    d = replay.links(ranks, slot=2)
    assert d[(2, replay.FWD, 0)] == [0, 1] and d[(3, replay.FWD, 0)] == [1]
    assert d[(2, replay.FWD, 1)] == [0] and d[(3, replay.FWD, 1)] == [0]
    assert d[(1, replay.BWD, 1)] == [] and d[(0, replay.BWD, 1)] == [2, 3]
    # Negative control: without the record, contiguous blocks.
    plain = [replace(r, peers={}) for r in ranks]
    assert replay.links(plain, slot=2)[(3, replay.FWD, 1)] == [1]


def test_links_join_every_encoder_to_the_llm_and_never_two_encoders():
    # image encoder pp 2 (stages 0-1), audio encoder pp 1 (stage 1), llm (stage 2), two generators
    # (stage 3; one of pp 2 reaching stage 4), all dp 1
    ranks = [_rc(0, 0, 0, [1], module="image"), _rc(1, 1, 0, [1], module="image"), _rc(2, 1, 0, [1], module="audio"),
             _rc(3, 2, 0, [1]), _rc(4, 3, 0, [1], module="gen_a"), _rc(5, 3, 0, [1], module="gen_b"),
             _rc(6, 4, 0, [1], module="gen_b")]
    d = replay.links(ranks, slot=1)
    fwd, bwd = replay.FWD, replay.BWD
    assert d[(3, fwd, 0)] == [1, 2] and d[(2, fwd, 0)] == [] and d[(1, fwd, 0)] == [0]
    assert d[(0, bwd, 0)] == [1] and d[(2, bwd, 0)] == [3] and d[(3, bwd, 0)] == [4, 5]
    assert d[(6, fwd, 0)] == [5] and d[(4, fwd, 0)] == [3] and d[(4, bwd, 0)] == []
    t, _ = replay.simulate_ranks(ranks, 1)  # the graph's ranks simulate without a cycle
    assert t > 0


def test_independent_replicas_beat_lock_step_and_single_replicas_match_it():
    chain = [_rc(0, 0, 0, [3, 1, 2], module="encoder"), _rc(1, 1, 0, [2, 2, 2]), _rc(2, 2, 0, [1, 4, 1], module="generator")]
    assert replay.simulate_ranks(chain, 1)[0] == pytest.approx(replay.simulate_step(chain, 3)[0])
    # two monolithic replicas whose heavy microbatches differ: lock-step pays both, replicas one each
    reps = [_rc(0, 0, 0, [9, 1], module="encoder"), _rc(1, 0, 1, [1, 9], module="encoder"),
            _rc(2, 1, 0, [2, 2]), _rc(3, 1, 1, [2, 2])]
    per_replica, events = replay.simulate_ranks(reps, 2)
    assert per_replica < replay.simulate_step(reps, 2)[0]
    assert {e["rank"] for e in events} == {0, 1, 2, 3} and len(events) == 4 * 2 * 2


def test_read_trace_converts_microseconds(tmp_path):
    from disttrain_ds.parallel.engine import write_trace

    write_trace([{"name": "forward", "mb": 2, "start": 10.0, "end": 10.25}], str(tmp_path / "rank3.json"), 3, "x", 10.0)
    assert replay.read_trace(tmp_path / "rank3.json") == [_span("forward", 2, 0.0, 250.0)]


# --------------------------------------------------------------------------- the wait and the records


def test_wait_holds_until_the_emulated_time_and_counts_overruns(tmp_path):
    emu = Emulator("llm", 1, 0, 1, ms_per_flop=1.0, backward=True, cost_model=None, patch_size=8, special=None)
    emu.fwd_ms, emu.bwd_ms = [40.0], [0.0]
    emu.steps.append({"step": 1, "fwd_ms": [40.0], "bwd_ms": [0.0], "prep_s": 0.0, "waited_s": 0.0,
                      "overruns": 0, "overrun_s": 0.0})
    t0 = time.perf_counter()
    emu.wait("fwd", 0, t0)
    assert time.perf_counter() - t0 >= 0.040
    emu.wait("fwd", 0, t0 - 1.0)  # started a second ago: already late, no sleep
    rec = emu.steps[-1]
    assert rec["waited_s"] > 0.03 and rec["overruns"] == 1 and rec["overrun_s"] > 0.9
    emu.save(tmp_path, 5)
    loaded = replay.load_records(tmp_path)
    assert loaded[1] == [RankCosts(5, "llm", 1, 0, (40.0,), (0.0,), 0.0)]
    assert replay.wait_summary(tmp_path)["overruns"] == 1


def test_records_missing_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="emulate"):
        replay.load_records(tmp_path)


def test_rank_costs_follow_the_recipe_data_and_average_to_the_profile(tmp_path):
    recipe = load_recipe(TINY, [*DISAGG, "emulate.enabled=true", f"emulate.profile={_profile(tmp_path)}",
                                "emulate.time_scale=0.5", "emulate.calibration_batches=3"])
    topo = topology_of(recipe)
    rates = emulate.recipe_rates(recipe, topo)
    flops = emulate.calibration_flops(recipe)
    per_sample = np.stack([flops[m] * rates[m] for m in ("encoder", "llm", "generator")], axis=1) * 3.0  # fwd + 2 x fwd
    assert per_sample.mean(axis=0) == pytest.approx([30.0, 100.0, 60.0])  # profile x time_scale
    assert per_sample[:, 0].std() > 0  # samples differ: variation comes from the data

    from disttrain_ds.runtime.setup import build_data_and_spec

    source, spec = build_data_and_spec(recipe)
    samples = source.global_batch(0)
    llm_stage1 = Emulator.for_rank(recipe, topo, 2, spec, backward=True)  # llm stage 1 of pp=2
    llm_stage1.set_step(0, [[s] for s in samples])
    expected = [per_sample[i, 1] / 3.0 / 2 for i in range(4)]  # forward, half the module
    assert llm_stage1.fwd_ms == pytest.approx(expected)
    assert llm_stage1.bwd_ms == pytest.approx([2 * x for x in expected])
    assert llm_stage1.global_stage == 2 and llm_stage1.steps[0]["step"] == 1


def _with_and_without_sp(tmp_path, extra: list[str], module: str, rank: int, sp_rank: int):
    """Emulators of step 0 on a slow all-to-all link: ``rank`` without SP, ``sp_rank`` (SP index 1)
    with ``module`` at SP 2; and the step's samples and the spec."""
    over = [*DISAGG, "emulate.enabled=true", f"emulate.profile={_profile(tmp_path)}", *extra,
            "parallel.sp_bandwidth_gbs=[0.001,0.001]"]
    from disttrain_ds.runtime.setup import build_data_and_spec

    plain, split = load_recipe(TINY, over), load_recipe(TINY, [*over, f"parallel.{module}.sp=2"])
    source, spec = build_data_and_spec(plain)
    samples = source.global_batch(0)
    one = Emulator.for_rank(plain, topology_of(plain), rank, spec, backward=True)
    two = Emulator.for_rank(split, topology_of(split), sp_rank, spec, backward=True)
    one.set_step(0, [[s] for s in samples])
    two.set_step(0, [[s] for s in samples])
    return one, two, samples, spec


def test_an_sp_rank_emulates_its_share_of_the_work_and_the_all_to_alls(tmp_path):
    """SP 2: each LLM rank waits half a sample's compute plus its all-to-alls (SPCost at
    parallel.sp_bandwidth_gbs), half of them forward and half backward."""
    one, two, samples, _ = _with_and_without_sp(tmp_path, ["parallel.llm.pp=1"], "llm", 1, 2)
    a2a = [two.sp_cost.a2a_ms(int(s.input_ids.shape[0]), 2) / 2 for s in samples]
    assert min(a2a) > 1.0  # a slow link: the all-to-alls show
    assert two.fwd_ms == pytest.approx([f / 2 + a for f, a in zip(one.fwd_ms, a2a)])
    assert two.bwd_ms == pytest.approx([b / 2 + a for b, a in zip(one.bwd_ms, a2a)])


def test_an_encoder_sp_rank_emulates_its_share_and_all_to_alls_of_its_item_rows(tmp_path):
    """The image encoder at SP 2: half a sample's compute plus the all-to-alls of the rows its images
    make (a sample without images: nothing to exchange)."""
    one, two, samples, spec = _with_and_without_sp(tmp_path, [], "encoder", 0, 1)
    rows = [spec.item_rows("encoder", s) for s in samples]
    assert rows == [sum((h // 8) * (w // 8) for _, h, w in (im.shape for im in s.images)) for s in samples]
    a2a = [two.sp_cost.a2a_ms(n, 2) / 2 for n in rows]
    assert max(a2a) > 1.0 and all((a == 0) == (n == 0) for a, n in zip(a2a, rows))
    assert two.fwd_ms == pytest.approx([f / 2 + a for f, a in zip(one.fwd_ms, a2a)])
    assert two.bwd_ms == pytest.approx([b / 2 + a for b, a in zip(one.bwd_ms, a2a)])


# --------------------------------------------------------------------------- recipe checks


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as exc:
        load_recipe(TINY, overrides)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_emulate_recipe_errors_name_the_key(tmp_path):
    assert "'emulate.enabled'" in _error(["emulate.enabled=true", "emulate.tflops=1"])  # reference layout
    assert "'emulate.tflops'" in _error([*DISAGG, "emulate.enabled=true"])
    assert "'emulate.profile'" in _error([*DISAGG, "emulate.enabled=true", "emulate.profile=/nope.json"])
    assert "'emulate.time_scale'" in _error([*DISAGG, "emulate.time_scale=-1"])
    assert "'emulate.calibration_batches'" in _error(["emulate.calibration_batches=0"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus": 4}')
    assert "bad.json" in _error([*DISAGG, "emulate.enabled=true", f"emulate.profile={bad}"])


VLM = REPO / "recipes" / "tiny_vlm.yaml"
VLM_DISAGG = ["layout=disaggregated", "train.global_batch=4", "emulate.enabled=true"]


def _vlm_profile(tmp_path: Path, costs={"vision": 30.0, "llm": 80.0}) -> Path:
    roles = {"vision": "encoder", "llm": "llm"}
    path = tmp_path / "vlm.json"
    path.write_text(json.dumps({"gpus": 3, "global_batch": 4, "modules": {
        m: {"role": roles[m], "layers": 2, "cost_ms": {"1": c}} for m, c in costs.items()}}))
    return path


def test_a_graph_recipe_emulates_its_own_modules_by_name(tmp_path):
    recipe = load_recipe(VLM, [*VLM_DISAGG, f"emulate.profile={_vlm_profile(tmp_path)}", "emulate.calibration_batches=2"])
    topo = topology_of(recipe)
    rates = emulate.recipe_rates(recipe, topo)
    flops = emulate.calibration_flops(recipe)
    assert set(rates) == set(flops) == {"vision", "llm"}
    for m, c in (("vision", 30.0), ("llm", 80.0)):  # the mean sample costs the profile's fwd+bwd
        assert float(np.mean(flops[m] * rates[m] * 3.0)) == pytest.approx(c)
    assert flops["vision"].std() > 0  # images differ in size: the ViT's cost follows them

    from disttrain_ds.runtime.setup import build_data_and_spec

    source, spec = build_data_and_spec(recipe)
    samples = source.global_batch(0)
    vision = Emulator.for_rank(recipe, topo, 0, spec, backward=True)
    assert (vision.module, vision.role, vision.global_stage) == ("vision", "encoder", 0)
    vision.set_step(0, [[s] for s in samples])
    assert vision.fwd_ms == pytest.approx([flops["vision"][i] * rates["vision"] for i in range(4)])
    llm_last = Emulator.for_rank(recipe, topo, 2, spec, backward=True)  # llm stage 1 of pp 2
    assert (llm_last.module, llm_last.global_stage) == ("llm", 2)


def test_a_graph_recipe_runs_emulated_on_tflops_and_refuses_a_profile_of_other_modules(tmp_path):
    ok = load_recipe(VLM, [*VLM_DISAGG, "emulate.tflops=1"])
    assert set(emulate.recipe_rates(ok, topology_of(ok))) == {"vision", "llm"}
    with pytest.raises(ConfigError) as exc:
        load_recipe(VLM, [*VLM_DISAGG, f"emulate.profile={_profile(tmp_path)}"])
    assert "'emulate.profile'" in str(exc.value) and "'vision'" in str(exc.value) and "\n" not in str(exc.value)


def test_profile_must_cost_the_modules_tp_degree(tmp_path):
    path = _profile(tmp_path, tps=("2",))
    assert "tp=1" in _error([*DISAGG, "emulate.enabled=true", f"emulate.profile={path}"])
    ok = load_recipe(TINY, [*DISAGG, "emulate.enabled=true", f"emulate.profile={_profile(tmp_path)}"])
    assert ok.emulate.enabled and ok.emulate.time_scale == 1.0


T2I = """\
name: tiny_t2i
seed: 1234
model:
  modules:
    llm: {family: llama, preset: tiny}
    painter: {family: unet, preset: tiny}
data: {source: synthetic, tokenizer: byte, seq_len: 128, max_images: 0, image_sizes: [16]}
parallel:
  modules:
    llm: {pp: 2}
train: {steps: 2, global_batch: 4, micro_batch: 1}
deepspeed_config: ds_configs/cpu_fp32.json
"""


def test_a_generation_only_graph_costs_its_generator_by_the_images_it_generates(tmp_path):
    path = tmp_path / "t2i.yaml"
    path.write_text(T2I)
    recipe = load_recipe(path, ["layout=disaggregated", "emulate.enabled=true", "emulate.tflops=1"])
    topo = topology_of(recipe)
    flops = emulate.calibration_flops(recipe)
    assert set(flops) == set(emulate.recipe_rates(recipe, topo)) == {"llm", "painter"}

    from disttrain_ds.runtime.setup import build_data_and_spec, cost_model

    source, spec = build_data_and_spec(recipe)
    samples = source.global_batch(0)
    painter = Emulator.for_rank(recipe, topo, 2, spec, backward=True)  # llm stages 0-1, then the painter
    assert (painter.module, painter.role, painter.global_stage) == ("painter", "generator", 2)
    painter.set_step(0, [[s] for s in samples])
    cm = cost_model(recipe)
    gen = [cm.module_cost("painter", s.stats(8, source.special)) for s in samples]
    assert any(g > 0 for g in gen) and painter.fwd_ms == pytest.approx([g * painter.ms_per_flop for g in gen])

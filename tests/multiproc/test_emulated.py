"""Emulated compute in a real 5-rank disaggregated run: the ranks really wait their modelled
times, the iteration is the simulator's critical path through the ops as they ran, and the math is
untouched.

The ranks share a few CPU cores (with whatever else the machine runs): an op whose real layers,
or whose wake-up from its wait, lose the core takes longer than its emulated time, and on the
critical path that lengthens the step. So the step is compared with the simulator fed every op's
measured duration (``schedule.replay.measured_costs``) and a crossing latency anywhere in the
interquartile range of the measured ones, and the emulated times are pinned per op: no op is
shorter than its emulated time, and what the ops took beyond it is what the ranks recorded as
overruns (real layers past the deadline) plus a little wake-up and bookkeeping.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime import emulate
from disttrain_ds.runtime.setup import build_data_and_spec, cost_model
from disttrain_ds.schedule import replay

from .conftest import REPO, launch

# encoder 1 -> llm dp 2 -> generator dp 2; 8 samples = 4 microbatches of 2 per step
LAYOUT = ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2",
          "train.global_batch=8", "train.steps=3", "optim.name=sgd", "optim.lr=0.05"]
COST_MS = {"encoder": 40.0, "llm": 90.0, "generator": 75.0}  # fwd+bwd per mean sample
TOLERANCE = 0.05
"""Relative slack around the simulated band (bookkeeping between ops the trace does not cover)."""
SHORTER = 0.85
"""Negative control: ops this much shorter than they ran must leave the measured step unexplained."""


def _spans(run) -> dict[int, list[dict]]:
    return {int(f.stem[4:]): replay.read_trace(f) for f in (run / "trace").glob("rank*.json")}


def simulated_band(recs, spans, slot: int, scale: float = 1.0) -> tuple[float, float]:
    """Iteration times (ms) the rank simulator gives with every op's measured duration (times
    ``scale``), the measured tails and data preparation, and a crossing latency from the 25th to
    the 75th percentile of the measured ones; widened by ``TOLERANCE``."""
    ov = replay.measure_overheads(spans, recs, slot)
    ran = [dataclasses.replace(r, fwd_ms=tuple(scale * x for x in r.fwd_ms), bwd_ms=tuple(scale * x for x in r.bwd_ms))
           for r in replay.measured_costs(spans, recs)]
    lat = replay.crossing_latencies(spans, recs, slot) or [ov.comm_ms]
    lo, hi = (max(0.0, float(np.percentile(lat, q))) for q in (25, 75))
    ends = [replay.simulate_ranks(ran, slot, dataclasses.replace(ov, op_ms=0.0, comm_ms=c))[0] for c in (lo, hi)]
    return (1 - TOLERANCE) * ends[0], (1 + TOLERANCE) * ends[1]


def beyond_overruns(run, step: int) -> tuple[float, float]:
    """(ms of forward/backward span time beyond the emulated times and the overruns the
    ranks recorded, ms emulated) over all ranks of ``step``: what an op takes after its wait."""
    extra = emulated = 0.0
    for f in (run / "emulate").glob("rank*.json"):
        rec = json.loads(f.read_text())
        s = next(x for x in rec["steps"] if x["step"] == step)
        ops = [x for x in replay.read_trace(run / "trace" / f.name) if x["name"] in ("forward", "backward")]
        beyond = sum(x["end"] - x["start"] for x in ops) - sum(s["fwd_ms"]) - sum(s["bwd_ms"]) - 1e3 * s["overrun_s"]
        assert beyond >= -1.0, (f.name, beyond)  # an overrun recorded that the trace does not show
        extra, emulated = extra + beyond, emulated + sum(s["fwd_ms"]) + sum(s["bwd_ms"])
    return extra, emulated


def check_step_time(rows, run, recs, slot: int, stages: int) -> None:
    """The ops waited their emulated times (an op ran longer only by what its real layers took
    past the deadline, as the rank recorded it), and the last step's time is explained by its ops
    as they ran, and not by ops shorter than that (negative control)."""
    measured, spans = 1e3 * rows[-1]["step_seconds"], _spans(run)
    ran = replay.measured_costs(spans, recs)
    took = [t for r in ran for t in (*r.fwd_ms, *r.bwd_ms)]
    assert min(t - e for t, e in zip(took, (e for r in recs for e in (*r.fwd_ms, *r.bwd_ms)))) >= -0.05
    # Beyond the overruns only the wake-up from the wait and bookkeeping remain (a few ms per op
    # even with 10 runnable processes per core); ranks that waited twice their costs would show
    # one emulated time more.
    extra, emulated = beyond_overruns(run, rows[-1]["step"])
    assert extra < 0.25 * emulated, (extra, emulated)

    compute_only, _ = replay.simulate_step(recs, stages)
    assert measured > 0.9 * compute_only  # tiny real layers alone would take a fraction of it
    lo, hi = simulated_band(recs, spans, slot)
    ideal, _ = replay.simulate_ranks(recs, slot, replay.measure_overheads(spans, recs, slot))
    load = (f"measured {measured:.1f} ms, simulated from the ops as they ran {lo:.1f}-{hi:.1f} ms, from the "
            f"emulated times plus the median overhead {ideal:.1f} ms; "
            f"{replay.wait_summary(run / 'emulate')['overruns']:.0f} ops overran their emulated time")
    assert lo <= measured <= hi, load
    short_lo, short_hi = simulated_band(recs, spans, slot, scale=SHORTER)
    assert not short_lo <= measured <= short_hi, load


@pytest.mark.slow
def test_emulated_run_waits_its_costs_and_matches_the_simulator(tmp_path, reference_run):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gpus": 5, "global_batch": 8, "modules": {
        m: {"layers": 2, "cost_ms": {"1": c}} for m, c in COST_MS.items()}}))
    emu = ["emulate.enabled=true", f"emulate.profile={profile}", "train.peak_tflops=1"]
    rows, _, _ = launch(tmp_path, 5, [*LAYOUT, *emu])
    run = tmp_path / "run"

    # The math is untouched: same losses as the single-process reference.
    ref_losses, _ = reference_run([o for o in LAYOUT if not o.startswith(("layout=", "parallel."))])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)

    # Every rank recorded the times of the samples it trained, computed as the pure functions do.
    recs = replay.load_records(run / "emulate")
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", [*LAYOUT, *emu])
    source, _ = build_data_and_spec(recipe)
    samples = source.global_batch(2)
    rates = emulate.recipe_rates(recipe, topology_of(recipe))
    cm, special = cost_model(recipe), source.special
    llm_dp1 = next(r for r in recs[3] if r.module == "llm" and r.dp == 1)
    expected = [rates["llm"] * cm.module_cost("llm", samples[2 * g + 1].stats(8, special)) for g in range(4)]
    assert llm_dp1.fwd_ms == pytest.approx(expected)
    assert llm_dp1.bwd_ms == pytest.approx([2 * x for x in expected])

    # Waits really happened: each forward/backward span lasts at least its emulated time.
    for f in (run / "trace").glob("rank*.json"):
        rank = int(f.stem[4:])
        mine = next(r for r in recs[3] if r.rank == rank)
        spans = replay.read_trace(f)
        fwd = [s["end"] - s["start"] for s in spans if s["name"] == "forward"]
        bwd = [s["end"] - s["start"] for s in spans if s["name"] == "backward"]
        assert all(d >= e - 0.05 for d, e in zip(fwd, mine.fwd_ms)), (rank, fwd, mine.fwd_ms)
        assert all(d >= e - 0.05 for d, e in zip(bwd, mine.bwd_ms)), (rank, bwd, mine.bwd_ms)
    assert replay.wait_summary(run / "emulate")["waited_s"] > 1.0

    # The last step's iteration time is the simulator's, fed the ops of that step as they ran.
    check_step_time(rows, run, recs[3], slot=2, stages=3)


# The understanding-only module graph: vision (dp 1) -> llm (dp 2); 8 samples = 4 microbatches of 2
VLM_LAYOUT = ["layout=disaggregated", "parallel.modules.vision.dp=1", "parallel.modules.llm.dp=2",
              "parallel.modules.llm.pp=1", "train.global_batch=8", "train.steps=3", "optim.name=sgd",
              "optim.lr=0.05"]
VLM_COST_MS = {"vision": ("encoder", 120.0), "llm": ("llm", 240.0)}  # well above the real tiny layers


@pytest.mark.slow
def test_emulated_module_graph_run_matches_the_simulator(tmp_path, reference_run):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gpus": 3, "global_batch": 8, "modules": {
        m: {"role": role, "layers": 2, "cost_ms": {"1": c}} for m, (role, c) in VLM_COST_MS.items()}}))
    emu = ["emulate.enabled=true", f"emulate.profile={profile}", "train.peak_tflops=1"]
    rows, _, _ = launch(tmp_path, 3, [*VLM_LAYOUT, *emu], recipe="tiny_vlm")
    run = tmp_path / "run"

    ref_losses, _ = reference_run([o for o in VLM_LAYOUT if not o.startswith(("layout=", "parallel."))], "tiny_vlm")
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)

    recs = replay.load_records(run / "emulate")
    assert {r.module for r in recs[3]} == {"vision", "llm"}
    recipe = load_recipe(REPO / "recipes" / "tiny_vlm.yaml", [*VLM_LAYOUT, *emu])
    source, _ = build_data_and_spec(recipe)
    samples = source.global_batch(2)
    rates = emulate.recipe_rates(recipe, topology_of(recipe))
    cm, special = cost_model(recipe), source.special
    vision = next(r for r in recs[3] if r.module == "vision")
    expected = [rates["vision"] * cm.module_cost("vision", s.stats(recipe.model.modules["vision"].patch_size, special))
                for s in samples]  # one replica: both samples of each microbatch
    assert vision.fwd_ms == pytest.approx([expected[2 * g] + expected[2 * g + 1] for g in range(4)])
    assert replay.wait_summary(run / "emulate")["waited_s"] > 1.0

    check_step_time(rows, run, recs[3], slot=2, stages=2)


@pytest.mark.slow
def test_emulated_generation_only_graph_run_matches_the_simulator(tmp_path, reference_run):
    from .test_graphs import T2I

    recipe_path = tmp_path / "t2i.yaml"
    recipe_path.write_text(T2I)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gpus": 3, "global_batch": 8, "modules": {
        "llm": {"layers": 2, "cost_ms": {"1": 200.0}},
        "painter": {"role": "generator", "layers": 5, "cost_ms": {"1": 150.0}}}}))
    layout = ["layout=disaggregated", "parallel.modules.llm.pp=1", "parallel.modules.llm.dp=2",
              "parallel.modules.painter.dp=1", "train.global_batch=8", "train.steps=3", "optim.name=sgd", "optim.lr=0.05"]
    emu = ["emulate.enabled=true", f"emulate.profile={profile}", "train.peak_tflops=1"]
    rows, _, _ = launch(tmp_path, 3, [*layout, *emu], recipe=str(recipe_path))
    run = tmp_path / "run"
    ref_losses, _ = reference_run([o for o in layout if not o.startswith(("layout=", "parallel."))], str(recipe_path))
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)

    recs = replay.load_records(run / "emulate")
    painter = next(r for r in recs[3] if r.module == "painter")
    assert painter.global_stage == 1 and sum(painter.fwd_ms) > 0 and painter.bwd_ms == tuple(2 * x for x in painter.fwd_ms)
    check_step_time(rows, run, recs[3], slot=2, stages=2)


# Two encoders, the second an audio encoder: vision 1 + ear 1 -> llm dp 2 -> painter 1; 4 microbatches of 2
OMNI_LAYOUT = ["layout=disaggregated", "parallel.modules.llm.dp=2", "parallel.modules.llm.pp=1",
               "train.global_batch=8", "train.micro_batch=1", "train.steps=3", "optim.name=sgd", "optim.lr=0.05"]
# fwd+bwd per mean sample, well above what the real tiny layers take on a busy shared CPU
OMNI_COST_MS = {"vision": ("encoder", 300.0), "ear": ("encoder", 400.0), "llm": ("llm", 800.0),
                "painter": ("generator", 600.0)}


@pytest.mark.slow
def test_emulated_image_and_audio_encoders_run_matches_the_simulator(tmp_path, reference_run):
    from disttrain_ds.families.whisper.estimates import forward_flops_per_clip

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gpus": 5, "global_batch": 8, "modules": {
        m: {"role": role, "layers": 2, "cost_ms": {"1": c}} for m, (role, c) in OMNI_COST_MS.items()}}))
    emu = ["emulate.enabled=true", f"emulate.profile={profile}", "train.peak_tflops=1"]
    rows, _, _ = launch(tmp_path, 5, [*OMNI_LAYOUT, *emu], recipe="tiny_omni")
    run = tmp_path / "run"
    ref_losses, _ = reference_run([o for o in OMNI_LAYOUT if not o.startswith(("layout=", "parallel."))], "tiny_omni")
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)

    # The audio encoder waited the cost of its clips: every sample of each microbatch (one replica).
    recs = replay.load_records(run / "emulate")
    assert {r.module for r in recs[3]} == {"vision", "ear", "llm", "painter"}
    recipe = load_recipe(REPO / "recipes" / "tiny_omni.yaml", [*OMNI_LAYOUT, *emu])
    source, _ = build_data_and_spec(recipe)
    samples = source.global_batch(2)
    rate = emulate.recipe_rates(recipe, topology_of(recipe))["ear"]
    cfg = recipe.model.modules["ear"]
    per = [rate * sum(forward_flops_per_clip(cfg, c.shape[1]) for c in s.audio) for s in samples]
    ear = next(r for r in recs[3] if r.module == "ear")
    assert ear.fwd_ms == pytest.approx([per[2 * g] + per[2 * g + 1] for g in range(4)]) and min(per) > 0
    assert "balance/ear_load_max" in rows[-1]
    assert replay.wait_summary(run / "emulate")["waited_s"] > 1.0

    check_step_time(rows, run, recs[3], slot=2, stages=3)


@pytest.mark.slow
def test_emulated_post_balanced_run_matches_the_simulator_with_each_microbatchs_links(tmp_path, reference_run):
    """Encoder and generator on two replicas each, post-balanced: each rank records which replicas
    it exchanged units with in every microbatch, and the simulator fed those links explains the step."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gpus": 6, "global_batch": 8, "modules": {
        m: {"layers": 2, "cost_ms": {"1": c}} for m, c in COST_MS.items()}}))
    emu = ["emulate.enabled=true", f"emulate.profile={profile}", "train.peak_tflops=1"]
    layout = [*LAYOUT, "parallel.encoder.dp=2", "parallel.post_balance=true", "data.gen_images=[0,2]"]
    rows, _, _ = launch(tmp_path, 6, [*layout, *emu])
    run = tmp_path / "run"
    ref_losses, _ = reference_run([o for o in layout if not o.startswith(("layout=", "parallel."))])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)

    recs = replay.load_records(run / "emulate")
    boundary = [r for r in recs[3] if r.peers]
    assert {r.module for r in boundary} == {"encoder", "llm", "generator"}
    # Somewhere a replica exchanged with another set than its contiguous block would give.
    blocks = replay.links([dataclasses.replace(r, peers={}) for r in recs[3]], slot=2)
    assert replay.links(recs[3], slot=2) != blocks
    check_step_time(rows, run, recs[3], slot=2, stages=3)


@pytest.mark.slow
@pytest.mark.parametrize("module, ranks, nproc, cost", [("llm", 4, 7, {}),
                                                        ("encoder", 2, 6, {"encoder": 160.0})])
def test_emulated_sp_run_matches_the_simulator(tmp_path, reference_run, module, ranks, nproc, cost):
    """LLM DP 2 x SP 2, or the image encoder at SP 2: each SP rank waits half its samples' compute
    plus the all-to-alls of their tokens or image rows (``Emulator``); the step is the simulator's,
    the losses the reference's. (The encoder's emulated cost is raised so that its halves stay
    above what its real layers and exchanges take on these cores: ops that overrun widen the
    simulated band past what the negative control can tell apart.)"""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gpus": 7, "global_batch": 8, "modules": {
        m: {"layers": 2, "cost_ms": {"1": c}} for m, c in {**COST_MS, **cost}.items()}}))
    emu = ["emulate.enabled=true", f"emulate.profile={profile}", "train.peak_tflops=1",
           "parallel.sp_bandwidth_gbs=[0.05,0.05]"]
    layout = [*LAYOUT, f"parallel.{module}.sp=2"]
    rows, _, _ = launch(tmp_path, nproc, [*layout, *emu])
    run = tmp_path / "run"
    ref_losses, _ = reference_run([o for o in layout if not o.startswith(("layout=", "parallel."))])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    recs = replay.load_records(run / "emulate")
    sp_ranks = [r for r in recs[3] if r.module == module]
    assert len(sp_ranks) == ranks and len({r.fwd_ms for r in sp_ranks if r.dp == 0}) == 1  # an SP group waits alike
    check_step_time(rows, run, recs[3], slot=2, stages=3)

"""The planner prices every stage's memory as the runtime's start-up check does (uneven stages,
each stage's received input and output), so ``--write-recipe`` plans pass that check the first
time; the check's loop stays as a safety net that prices up only the module it refused."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from disttrain_ds.cli import plan as cli
from disttrain_ds.cost import memory_model as mm
from disttrain_ds.cost.profile import GIB
from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.planner import recipe_plan
from disttrain_ds.planner.legal import restrict_to_runtime
from disttrain_ds.planner.objective import Degrees, layout_memory
from disttrain_ds.planner.optimize import PlanError, exhaustive_plan, plan
from disttrain_ds.planner.recipe_memory import fit_plan, runtime_peaks, with_recipe_memory
from disttrain_ds.recipe.schema import find_recipe, load_recipe


def test_worst_stage_counts_one_microbatch_less_in_flight_per_stage_and_takes_the_largest():
    # Stage 0: few parameters, most in flight; stage 1: the head's parameters, one fewer in flight.
    table = {(1, 2): (mm.StageBytes(100.0, 10.0, 1.0), mm.StageBytes(1000.0, 10.0, 1.0))}
    per_param = (4.0, 4.0, 8.0)
    got = mm.worst_stage_bytes(table, 1, 2, per_param, 1, samples=2, to_end=5, microbatches=4)
    stage0 = 100 * 16 + min(5, 4) * 2 * 10.0 + 2 * 1.0
    stage1 = 1000 * 16 + min(4, 4) * 2 * 10.0 + 2 * 1.0
    assert got == max(stage0, stage1) == stage1
    # Fewer microbatches than stages: stage s keeps in_flight(to_end - s) of them.
    lean = {(1, 2): (mm.StageBytes(0.0, 10.0, 0.0), mm.StageBytes(0.0, 30.0, 0.0))}
    assert mm.worst_stage_bytes(lean, 1, 2, per_param, 1, 1, to_end=2, microbatches=8) == max(2 * 10.0, 1 * 30.0)
    # Elementwise over numpy columns, one table entry per (tp, pp).
    import numpy as np
    both = {**table, (2, 1): (mm.StageBytes(1100.0, 20.0, 2.0),)}
    col = mm.worst_stage_bytes(both, np.array([1, 2]), np.array([2, 1]), per_param, 1, 2, np.array([5, 4]), 4)
    assert list(col) == [stage1, 1100 / 2 * 16 + 4 * 2 * 20.0 + 2 * 2.0]
    with pytest.raises(ValueError, match=r"no stage table for \(tp, pp\) \[\(1, 4\)\]"):
        mm.worst_stage_bytes(table, 1, 4, per_param, 1, 1, 4, 4)


def test_extra_bytes_per_rank_add_to_every_layout_of_their_module_only():
    data = {"gpus": 4, "global_batch": 4, "gpu_memory_gb": 10, "modules": {
        "encoder": {"layers": 1, "cost_ms": {"1": 1.0}, "params": 1e6},
        "llm": {"layers": 2, "cost_ms": {"1": 1.0}, "params": 1e6},
        "generator": {"layers": 1, "cost_ms": {"1": 1.0}, "params": 1e6}}}
    profile = profile_from_dict(data)
    layout = {n: Degrees(1, 1, 1) for n in profile.graph.names}
    before = layout_memory(profile, layout)
    vae = dataclasses.replace(profile.modules["generator"], extra_bytes_per_rank=3e8)
    after = layout_memory(dataclasses.replace(profile, modules={**profile.modules, "generator": vae}), layout)
    assert after["generator"] == before["generator"] + 3e8
    assert after["llm"] == before["llm"] and after["encoder"] == before["encoder"]


TINY_PROFILE = {"gpus": 16, "global_batch": 4, "microbatch": 1, "gpus_per_node": 8, "modules": {
    "encoder": {"layers": 2, "cost_ms": {"1": 12.0, "2": 7.0}},
    "llm": {"layers": 4, "cost_ms": {"1": 40.0, "2": 22.0}},
    "generator": {"layers": 2, "cost_ms": {"1": 18.0}}}}

LAYOUTS = {  # name: recipe overrides (tiny_cpu: global batch 4, micro batch 1)
    "llm pp 2": ["parallel.llm.pp=2"],
    "llm pp 4, encoder pp 2": ["parallel.llm.pp=4", "parallel.encoder.pp=2"],
    "llm tp 2": ["parallel.llm.tp=2", "parallel.llm.pp=1"],
    "llm tp 2 x pp 2, generator pp 2": ["parallel.llm.tp=2", "parallel.llm.pp=2", "parallel.generator.pp=2"],
    "llm dp 2": ["parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"],
    "llm pp 2, checkpointing": ["parallel.llm.pp=2", "parallel.llm.activation_checkpointing=1"],
    "llm dp 2, ZeRO-1": ["parallel.llm.dp=2", "parallel.llm.pp=1", "deepspeed_config=ds_configs/zero1.json"],
    "bf16, llm pp 2": ["parallel.llm.pp=2", "train.dtype=bf16"],
}


@functools.lru_cache(maxsize=None)
def _recipe_profile(extra: tuple[str, ...] = ()):
    base = load_recipe("tiny_cpu", ["layout=disaggregated", *extra])
    profile = restrict_to_runtime(profile_from_dict(TINY_PROFILE), base)[0]
    return with_recipe_memory(profile, base)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_planner_prices_each_module_at_the_runtime_estimate_of_its_most_loaded_rank(name):
    overrides = ["layout=disaggregated", *LAYOUTS[name]]
    recipe = load_recipe("tiny_cpu", overrides)
    # Recipe-wide settings (dtype, ZeRO, checkpointing) reach the profile through the probe recipe.
    setting = tuple(o for o in LAYOUTS[name] if not o.split("=")[0].endswith((".dp", ".tp", ".pp")))
    profile = _recipe_profile(setting)
    layout = {n: Degrees(recipe.parallel.modules[n].dp, recipe.parallel.modules[n].tp, recipe.parallel.modules[n].pp)
              for n in profile.graph.names}
    priced, runtime = layout_memory(profile, layout), runtime_peaks(recipe)
    for n in profile.graph.names:
        assert priced[n] == pytest.approx(runtime[n], rel=1e-12), n


def test_even_stages_miss_what_the_runtime_counts_on_some_stage():
    # Negative control: the per-sample figures spread evenly over stages (no stage table) price
    # the LLM at PP 2 below the runtime's estimate of its most loaded rank.
    profile = _recipe_profile()
    even = {n: dataclasses.replace(s, stages=None) for n, s in profile.modules.items()}
    layout = {"encoder": Degrees(1, 1, 1), "llm": Degrees(1, 1, 2), "generator": Degrees(1, 1, 1)}
    recipe = load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.llm.pp=2"])
    assert layout_memory(dataclasses.replace(profile, modules=even), layout)["llm"] < runtime_peaks(recipe)["llm"]


# Planned for tiny_cpu under a limit of a few MiB: with even stages, its best plans were refused
# by the runtime six times in a row and the old loop, lowering one limit for every module, gave up.
GAVE_UP = {"gpus": 11, "global_batch": 4, "gpus_per_node": 8, "microbatch": 1, "gpu_memory_gb": 0.00616,
           "modules": {"encoder": {"layers": 4, "cost_ms": {"1": 839.0}},
                       "llm": {"layers": 4, "cost_ms": {"1": 1979.0, "2": 1168.0}},
                       "generator": {"layers": 6, "cost_ms": {"1": 33.2, "2": 24.6, "4": 8.6}}}}


def _gave_up_inputs():
    base = load_recipe("tiny_cpu", ["layout=disaggregated"])
    profile = with_recipe_memory(restrict_to_runtime(profile_from_dict(GAVE_UP), base)[0], base)
    return profile, lambda p: recipe_plan.planned_recipe(find_recipe("tiny_cpu"), p, False)


def test_plan_the_old_loop_gave_up_on_is_written_and_passes_the_runtime_check_the_first_time(run_main, tmp_path):
    path, out = tmp_path / "p.json", tmp_path / "planned.yaml"
    path.write_text(json.dumps(GAVE_UP))
    code, _, err = run_main(cli.main, "--profile", str(path), "--recipe", "tiny_cpu", "--write-recipe", str(out))
    assert code == 0, err
    assert max(runtime_peaks(load_recipe(out)).values()) <= GAVE_UP["gpu_memory_gb"] * GIB
    profile, recipe_for = _gave_up_inputs()
    calls = []
    result = fit_plan(profile, lambda p: calls.append(p) or plan(p), recipe_for, GAVE_UP["gpu_memory_gb"])
    assert len(calls) == 1  # no second round: the planner's figures are the runtime's
    assert result.to_json() == exhaustive_plan(profile).to_json()  # and it is the fastest that fits


def test_safety_net_strikes_off_only_the_refused_layouts_and_finds_a_fitting_plan():
    # With even stages (the planner's old view) the first plans are refused; the loop must still
    # end with a plan the runtime accepts, never lowering the limit or touching other layouts.
    profile, recipe_for = _gave_up_inputs()
    even = dataclasses.replace(profile, modules={n: dataclasses.replace(s, stages=None)
                                                 for n, s in profile.modules.items()})
    limit = GAVE_UP["gpu_memory_gb"]
    seen = []
    result = fit_plan(even, lambda p: seen.append(p) or plan(p), recipe_for, limit)
    assert len(seen) > 1  # the safety net ran
    assert max(runtime_peaks(recipe_for(result)).values()) <= limit * GIB
    assert all(p.gpu_memory_gb == limit for p in seen)  # one limit, untouched
    for before, after in zip(seen, seen[1:]):  # each round strikes off what the runtime refused
        struck = {n: after.modules[n].refused - before.modules[n].refused for n in after.modules}
        assert any(struck.values()) and all(len(s) <= 1 for s in struck.values())
        assert all(dataclasses.replace(after.modules[n], refused=frozenset()) == even.modules[n]
                   for n in after.modules)


def test_nothing_left_after_refusals_is_one_line_naming_the_refused_plan():
    profile, recipe_for = _gave_up_inputs()
    with pytest.raises(PlanError, match=r"^the runtime's memory check refused \d+ plan\(s\) \(last: encoder .* GiB "
                       r"on a rank, limit 0.002 GiB\) and no other layout fits \(.*\)$"):
        # A planner limit far above the runtime's: every plan it finds is refused until none is left.
        fit_plan(dataclasses.replace(profile, gpu_memory_gb=1.0), plan, recipe_for, 0.002)


def test_zero1_gradient_buckets_add_one_beside_the_activations_or_two_at_the_reduce():
    # Measured with bench/memory_probe.py: every ZeRO-1 rank holds one 191 MiB bucket
    # (ds_configs/zero1.json's 5e7 fp32 elements) during backward and two at the gradient reduce.
    assert mm.with_buckets(100.0, 0.0) == 100.0
    assert mm.with_buckets(300.0, 200.0) == 500.0  # activations + one bucket
    assert mm.with_buckets(100.0, 200.0) == 400.0  # two buckets, the activations gone
    from disttrain_ds.estimate.memory import estimate, reduce_bucket_bytes

    zero1 = load_recipe("tiny_cpu", ["layout=disaggregated", "deepspeed_config=ds_configs/zero1.json"])
    assert reduce_bucket_bytes(zero1, "llm") == 4 * 50_000_000
    zero0 = load_recipe("tiny_cpu", ["layout=disaggregated"])
    assert reduce_bucket_bytes(zero0, "llm") == 0.0
    frozen = load_recipe("tiny_cpu", ["layout=disaggregated", "deepspeed_config=ds_configs/zero1.json",
                                      "model.encoder.frozen=true", "model.encoder.projector.frozen=true"])
    assert reduce_bucket_bytes(frozen, "encoder") == 0.0  # no optimizer, no buckets
    llm = next(r for r in estimate(zero1) if r.module == "llm")
    assert llm.bucket == 4 * 50_000_000 > llm.activations  # the tiny model: the reduce is the peak
    assert llm.total == llm.weights + llm.grads + llm.optimizer + 2 * llm.bucket

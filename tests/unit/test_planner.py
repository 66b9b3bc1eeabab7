"""The orchestration optimizer: exact against brute force, fast at paper scale, clear when stuck."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from pathlib import Path

import pytest

from disttrain_ds.cost.profile import GIB, Profile, ProfileError
from disttrain_ds.cost.profile_file import load_profile, profile_from_dict, profile_to_dict, save_profile
from disttrain_ds.graph import MODULES
from disttrain_ds.paper import load_paper_figures
from disttrain_ds.planner import optimize
from disttrain_ds.planner.baselines import megatron_plan, ratio_plan, ratio_split
from disttrain_ds.planner.optimize import Degrees, PlanError, divisors, exhaustive_plan, memory_per_gpu, plan, t_iter

EXAMPLES = Path(optimize.__file__).parent / "examples"


def random_profile(seed: int, ties: bool = False) -> Profile:
    """A small random instance (N <= 48, BS <= 32); ``ties`` uses ideal TP scaling and round
    costs so many layouts share one T_iter and the tie-break is exercised."""
    r = random.Random(seed)
    bs = r.randint(1, 32)
    mods = {}
    for name in MODULES:
        tps = sorted({1} | set(r.sample([2, 4, 8], r.randint(0, 3))))
        c1 = r.choice([8, 16, 24]) if ties else r.uniform(5, 200)
        mod: dict = {"layers": r.choice([1, 2, 3, 4, 6, 8, 12]),
                     "cost_ms": {str(t): c1 / t if ties else c1 / t ** r.uniform(0.5, 1.1)
                                 for t in tps}}
        if not ties and r.random() < 0.5:
            mod.update(params=r.uniform(1e8, 4e9), activation_bytes_per_sample=r.uniform(1e8, 4e9),
                       frozen=r.random() < 0.2)
        mods[name] = mod
    data = {"gpus": r.randint(3, 48), "global_batch": bs, "gpus_per_node": r.choice([4, 8, 8]),
            "microbatch": r.choice([m for m in (1, 2, 4) if bs % m == 0] + [1, 1]),
            "modules": mods}
    if not ties and r.random() < 0.5:
        data["gpu_memory_gb"] = r.uniform(8, 60)
    return profile_from_dict(data, src=f"random-{seed}")


def outcome(solver, profile: Profile):
    try:
        return solver(profile).to_json()
    except PlanError as exc:
        return f"PlanError: {exc}"


def tiny() -> dict:
    return json.loads((EXAMPLES / "tiny_cpu.json").read_text())


@pytest.mark.parametrize("seed", range(40))
def test_optimum_equals_exhaustive_search_on_random_instance(seed):
    profile = random_profile(seed)
    assert outcome(plan, profile) == outcome(exhaustive_plan, profile)


@pytest.mark.parametrize("seed", range(20))
def test_optimum_without_the_node_rule_equals_exhaustive_search(seed):
    profile = random_profile(seed)
    assert outcome(functools.partial(plan, aligned=False), profile) == \
        outcome(functools.partial(exhaustive_plan, aligned=False), profile)


@pytest.mark.parametrize("seed", range(20))
def test_optimum_equals_exhaustive_search_where_the_node_rule_binds(seed):
    # Strong TP scaling and small nodes: the unconstrained optimum often starts a module off its
    # TP degree's multiple, so the aligned search has to find a different plan.
    r = random.Random(1000 + seed)
    data = profile_to_dict(random_profile(seed))
    data["gpus_per_node"] = r.choice([2, 4, 8])
    for mod in data["modules"].values():
        c1 = r.uniform(5, 200)
        mod["cost_ms"] = {str(t): c1 / t ** 0.95 for t in (1, 2, 4, 8)}
    profile = profile_from_dict(data)
    assert outcome(plan, profile) == outcome(exhaustive_plan, profile)


def test_node_rule_binds_on_some_of_the_instances_above():
    # Guards the test above from comparing instances the rule never touches.
    binding = 0
    for seed in range(40):
        r = random.Random(1000 + seed)
        data = profile_to_dict(random_profile(seed))
        data["gpus_per_node"] = r.choice([2, 4, 8])
        for mod in data["modules"].values():
            c1 = r.uniform(5, 200)
            mod["cost_ms"] = {str(t): c1 / t ** 0.95 for t in (1, 2, 4, 8)}
        profile = profile_from_dict(data)
        binding += outcome(plan, profile) != outcome(functools.partial(plan, aligned=False), profile)
    assert binding >= 3


@pytest.mark.parametrize("seed", range(12))
def test_tie_break_matches_exhaustive_search_when_many_layouts_tie(seed):
    profile = random_profile(seed, ties=True)
    assert plan(profile).to_json() == exhaustive_plan(profile).to_json()


def test_random_instances_are_mostly_feasible_so_the_comparison_means_something():
    feasible = sum(not isinstance(outcome(plan, random_profile(s)), str) for s in range(40))
    assert feasible >= 30


@pytest.mark.parametrize("seed", range(40))
def test_plan_satisfies_every_constraint(seed):
    profile = random_profile(seed)
    try:
        result = plan(profile)
    except PlanError:
        pytest.skip("infeasible instance")
    assert result.gpus <= profile.gpus
    d = result.llm.dp * profile.microbatch
    assert profile.global_batch % d == 0
    assert result.microbatches == profile.global_batch // d
    for name in MODULES:
        m, spec = result.module(name), profile.module(name)
        assert m.gpus == m.dp * m.tp * m.pp and d % m.dp == 0 and spec.layers % m.pp == 0
        assert m.tp in spec.cost_ms and m.tp <= profile.gpus_per_node
        if profile.gpu_memory_gb is not None and m.memory_gib is not None:
            assert m.memory_gib <= profile.gpu_memory_gb
    layout = {n: Degrees(result.module(n).dp, result.module(n).tp, result.module(n).pp)
              for n in MODULES}
    assert t_iter(profile, layout).total_ms == result.t_iter_ms


def test_t_iter_uses_cost_at_tp_as_given_without_dividing_by_tp():
    profile = profile_from_dict({**tiny(), "global_batch": 8, "microbatch": 2})
    layout = {"encoder": Degrees(1, 2, 1), "llm": Degrees(2, 2, 2), "generator": Degrees(4, 1, 2)}
    c = {n: profile.module(n).cost_ms for n in MODULES}
    w_llm, w_enc, w_gen = 2 * c["llm"][2], 4 * c["encoder"][2], 1 * c["generator"][1]
    k = 8 // 4
    expected_steady = max(w_llm / 2, w_enc / 1, w_gen / 2) * (k - 1)
    got = t_iter(profile, layout)
    assert got.warmup_ms == pytest.approx(w_llm + w_enc + w_gen)
    assert got.steady_ms == pytest.approx(expected_steady)
    assert got.total_ms == pytest.approx(got.warmup_ms + got.steady_ms)


def test_paper_scale_instance_plans_within_its_gpus():
    """Its planning time is a benchmark's figure (``bench/bench_planner.py``), not a test's."""
    profile = load_profile(EXAMPLES / "mllm_72b_1296gpus.json")
    assert (profile.gpus, profile.global_batch) == (1296, 1920)
    result = plan(profile)
    assert result.gpus <= 1296


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")), ids=lambda p: p.name)
def test_shipped_example_loads_round_trips_and_plans(path, tmp_path):
    profile = load_profile(path)
    save_profile(profile, tmp_path / "copy.json")
    assert load_profile(tmp_path / "copy.json") == profile
    assert plan(profile).t_iter_ms > 0


def test_tiny_example_plan_is_the_exhaustive_optimum():
    profile = load_profile(EXAMPLES / "tiny_cpu.json")
    assert plan(profile).to_json() == exhaustive_plan(profile).to_json()


def test_paper_example_is_derived_from_the_papers_figure3():
    paper = load_paper_figures()
    fwd = paper["forward_ms_profile_fig3"]["8img_1024"]
    profile = load_profile(EXAMPLES / "mllm_72b_1296gpus.json")
    # backward = 2 x forward; the LLM figure is one of PP=10 stages at TP=8
    assert profile.module("llm").cost_ms[8] == pytest.approx(3 * 10 * fwd["llm_stage"])
    assert profile.module("encoder").cost_ms[1] == pytest.approx(3 * fwd["vit_huge"])
    assert profile.module("generator").cost_ms[1] == pytest.approx(3 * fwd["sd21"])


def test_disttrain_beats_the_papers_megatron_layout_at_paper_scale():
    paper = load_paper_figures()
    layout = paper["megatron_baseline_layout"]
    profile = load_profile(EXAMPLES / "mllm_72b_1296gpus.json")
    rigid = megatron_plan(profile, tp=layout["tp"], pp=layout["pp_llm"]["MLLM-72B"])
    assert rigid.gpus == 1152  # the paper's Megatron-LM run of MLLM-72B used 1152 GPUs
    assert plan(profile).t_iter_ms < rigid.t_iter_ms


@pytest.mark.parametrize("seed", range(20))
def test_baselines_are_never_faster_than_the_optimum(seed):
    profile = random_profile(seed)
    try:
        best = plan(profile).t_iter_ms
    except PlanError:
        pytest.skip("infeasible instance")
    llm = profile.module("llm")
    for tp in llm.tp_degrees(profile.gpus_per_node):
        for pp in divisors(llm.layers):
            try:
                rigid = megatron_plan(profile, tp=tp, pp=pp)
            except PlanError:
                continue
            assert rigid.t_iter_ms >= best
    try:
        assert ratio_plan(profile).t_iter_ms >= best
    except PlanError:
        pass


def test_megatron_layout_uses_tp_times_pp_plus_two_gpus_per_replica_and_largest_dp():
    profile = profile_from_dict({**tiny(), "gpus": 40, "global_batch": 12})
    result = megatron_plan(profile, tp=2, pp=2)
    assert result.gpus == 4 * 2 * (2 + 2)  # dp=5 fits in 40 GPUs but does not divide 12
    c = {n: profile.module(n).cost_ms for n in MODULES}
    k = 12 // 4
    steady = max(c["llm"][2] / 2, c["encoder"][1], c["generator"][1]) * (k - 1)
    assert result.t_iter_ms == pytest.approx(c["llm"][2] + c["encoder"][1] + c["generator"][1]
                                             + steady)


def test_ratio_split_follows_cost_at_tp1_and_uses_every_gpu():
    profile = profile_from_dict({**tiny(), "gpus": 70})
    split = ratio_split(profile)
    assert sum(split.values()) == 70
    assert split["llm"] > split["generator"] > split["encoder"]
    result = ratio_plan(profile)
    assert all(result.module(n).gpus <= split[n] for n in MODULES)


def test_binding_memory_limit_changes_the_plan_and_is_respected():
    data = tiny()
    data["gpus"], data["global_batch"] = 16, 16
    data["modules"]["llm"].update(params=2e9, activation_bytes_per_sample=4e9)
    free = plan(profile_from_dict(data))
    limit = free.llm.memory_gib * 0.9
    tight = profile_from_dict({**data, "gpu_memory_gb": limit})
    result = plan(tight)
    assert result.llm.memory_gib <= limit
    assert (result.llm.dp, result.llm.tp, result.llm.pp) != (free.llm.dp, free.llm.tp,
                                                             free.llm.pp)
    assert result.t_iter_ms >= free.t_iter_ms
    assert result.to_json() == exhaustive_plan(tight).to_json()


def test_memory_counts_zero1_shards_and_in_flight_microbatches():
    spec = profile_from_dict(tiny()).module("llm")
    spec = type(spec)(layers=4, cost_ms={1: 1.0}, params=8e9, activation_bytes_per_sample=1e9)
    got = memory_per_gpu(spec, Degrees(dp=4, tp=2, pp=2), samples_per_microbatch=3, stages_to_end=2, microbatches=2)
    # Activations are whole on every TP rank unless the profile says which part TP splits.
    assert got == pytest.approx(8e9 / 4 * (2 + 2 + 12 / 4) + 2 * 3 * 1e9 / 2)
    half = dataclasses.replace(spec, activation_tp_sharded=0.5)
    got = memory_per_gpu(half, Degrees(dp=4, tp=2, pp=2), samples_per_microbatch=3, stages_to_end=2, microbatches=2)
    assert got == pytest.approx(8e9 / 4 * (2 + 2 + 12 / 4) + 2 * 3 * (0.5e9 + 0.5e9 / 2) / 2)
    frozen = type(spec)(layers=4, cost_ms={1: 1.0}, params=8e9, frozen=True)
    assert memory_per_gpu(frozen, Degrees(1, 1, 1), samples_per_microbatch=1,
                          stages_to_end=1, microbatches=1) == pytest.approx(8e9 * 2)


def one_line_plan_error(data: dict) -> str:
    with pytest.raises(PlanError) as info:
        plan(profile_from_dict(data))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_too_few_gpus_names_the_minimum_needed():
    assert one_line_plan_error({**tiny(), "gpus": 2}) == \
        "needs at least 3 GPUs (encoder 1 + llm 1 + generator 1), profile has 2"


def test_memory_that_fits_only_on_more_gpus_says_so():
    data = tiny()
    data["gpus"], data["gpu_memory_gb"] = 5, 10
    data["modules"]["llm"]["params"] = 4 * 10 * GIB / 16  # needs 4 GPUs to hold its states
    assert one_line_plan_error(data) == \
        "needs at least 6 GPUs to fit in memory (encoder 1 + llm 4 + generator 1), profile has 5"


def test_model_too_big_for_any_layout_names_module_and_limit():
    data = tiny()
    data["gpu_memory_gb"] = 1
    data["modules"]["generator"]["params"] = 1e12
    assert one_line_plan_error(data).startswith("generator: no layout fits in 1 GiB per GPU")


def test_microbatch_not_dividing_batch_is_reported():
    assert one_line_plan_error({**tiny(), "global_batch": 6, "microbatch": 4}).startswith(
        "global_batch 6 is not divisible by microbatch 4")


def test_no_tp_degree_within_a_node_is_reported():
    data = tiny()
    data["modules"]["llm"]["cost_ms"] = {"8": 5.0}
    data["gpus_per_node"] = 4
    assert one_line_plan_error(data) == \
        "llm: no TP degree in cost_ms (8) divides gpus_per_node (4)"


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("global_batch"), "global_batch"),
    (lambda d: d.update(gpus="many"), "gpus"),
    (lambda d: d["modules"].update(decoder=d["modules"]["llm"]), "modules.decoder"),
    (lambda d: d["modules"]["llm"].pop("layers"), "modules.llm.layers"),
    (lambda d: d["modules"]["encoder"]["cost_ms"].update({"3": 1.0}), "modules.encoder.cost_ms.3"),
    (lambda d: d["modules"]["generator"].update(frozen="yes"), "modules.generator.frozen"),
    (lambda d: d.update(gpu_memory_gb=-1), "gpu_memory_gb"),
])
def test_bad_profile_gives_one_line_naming_field_and_file(tmp_path, mutate, field):
    data = tiny()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"'{field}'" in message


def test_profile_dict_round_trip_keeps_every_field():
    profile = load_profile(EXAMPLES / "mllm_72b_1296gpus.json")
    assert profile_from_dict(json.loads(json.dumps(profile_to_dict(profile)))) == profile


def test_too_few_gpus_for_the_smallest_tp_degree_does_not_blame_memory():
    data = tiny()
    data["gpus"], data["gpu_memory_gb"] = 5, 80
    data["modules"]["llm"]["cost_ms"] = {"4": 13.0}
    assert one_line_plan_error(data) == \
        "needs at least 6 GPUs (encoder 1 + llm 4 + generator 1), profile has 5"


# --- activation checkpointing in the memory model -------------------------------------------------


def test_checkpointed_activations_keep_one_layer_output_per_block_and_one_block():
    spec = profile_from_dict({"gpus": 8, "global_batch": 8, "modules": {
        "encoder": {"layers": 1, "cost_ms": {"1": 1.0}},
        "llm": {"layers": 12, "cost_ms": {"1": 1.0}, "activation_bytes_per_sample": 1200.0,
                "layer_output_bytes_per_sample": 10.0, "activation_checkpointing": 4},
        "generator": {"layers": 1, "cost_ms": {"1": 1.0}}}}).modules["llm"]
    # pp=2: 6 layers per stage in blocks of 4 -> 2 blocks; tp=2, 3 microbatches of 2 samples;
    # layer outputs (and here every activation) are whole on each TP rank.
    got = memory_per_gpu(spec, Degrees(1, 2, 2), samples_per_microbatch=2, stages_to_end=3, microbatches=3)
    assert got == 3 * 2 * (2 * 10.0) + 2 * (4 * 1200.0 / 12)
    split = dataclasses.replace(spec, activation_tp_sharded=1.0)  # the recomputed block splits
    assert memory_per_gpu(split, Degrees(1, 2, 2), samples_per_microbatch=2, stages_to_end=3, microbatches=3) \
        == 3 * 2 * (2 * 10.0) + 2 * (4 * 1200.0 / 12) / 2
    plain = dataclasses.replace(spec, activation_checkpointing=0)
    assert memory_per_gpu(plain, Degrees(1, 2, 2), samples_per_microbatch=2, stages_to_end=3, microbatches=3) \
        == 3 * 2 * 1200.0 / 2
    # A block larger than the stage: the stage is one block.
    assert memory_per_gpu(dataclasses.replace(spec, activation_checkpointing=100), Degrees(1, 1, 4),
                          samples_per_microbatch=1, stages_to_end=1, microbatches=1) == 10.0 + 3 * 100.0


@pytest.mark.parametrize("seed", range(15))
def test_optimum_with_activation_checkpointing_equals_exhaustive_search(seed):
    r = random.Random(500 + seed)
    data = profile_to_dict(random_profile(seed))
    data["gpu_memory_gb"] = r.uniform(4, 40)
    for mod in data["modules"].values():
        mod.update(activation_checkpointing=r.choice([0, 1, 2, 3]), params=r.uniform(1e8, 4e9),
                   activation_bytes_per_sample=r.uniform(1e9, 2e10),
                   layer_output_bytes_per_sample=r.uniform(1e7, 1e9))
    profile = profile_from_dict(data)
    assert outcome(plan, profile) == outcome(exhaustive_plan, profile)


def test_checkpointing_lets_a_layout_fit_that_does_not_without_it():
    data = tiny()
    data.update(gpu_memory_gb=1.0, gpus=16)
    data["modules"]["llm"].update(activation_bytes_per_sample=8 * GIB, layer_output_bytes_per_sample=0.01 * GIB,
                                  activation_tp_sharded=1.0)
    with pytest.raises(PlanError, match="needs at least 66 GPUs to fit in memory .* profile has 16"):
        plan(profile_from_dict(data))
    data["modules"]["llm"]["activation_checkpointing"] = 1
    assert plan(profile_from_dict(data)).module("llm").memory_gib <= 1.0

"""The planner over module graphs: roles in profiles, the generalised objective, exact search."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from disttrain_ds.cost.profile import ModuleProfile, Profile, ProfileError
from disttrain_ds.cost.profile_file import load_profile, profile_from_dict, profile_to_dict
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner import optimize
from disttrain_ds.planner.baselines import megatron_plan, ratio_plan, ratio_split
from disttrain_ds.planner.objective import combine, combine_arrays
from disttrain_ds.planner.optimize import Degrees, PlanError, build_plan, exhaustive_plan, plan, t_iter

EXAMPLES = Path(optimize.__file__).parent / "examples"

GRAPHS = {
    "two_encoders": {"image": "encoder", "audio": "encoder", "llm": "llm",
                     "generator": "generator"},
    "two_generators": {"llm": "llm", "image_gen": "generator", "speech_gen": "generator"},
    "no_generator": {"encoder": "encoder", "llm": "llm"},
    "no_encoder": {"llm": "llm", "generator": "generator"},
}


def graph_profile(roles: dict[str, str], seed: int, ties: bool = False) -> Profile:
    """A small random instance of the graph ``roles`` (N <= 32, BS <= 16, up to 4 layers, TP in
    1, 2, 4), small enough for the brute force; ``ties`` makes many layouts share one T_iter."""
    r = random.Random(seed)
    bs = r.randint(1, 16)
    mods = {}
    for name, role in roles.items():
        tps = sorted({1} | set(r.sample([2, 4], r.randint(0, 2))))
        c1 = r.choice([8, 16, 24]) if ties else r.uniform(5, 200)
        mod: dict = {"layers": r.choice([1, 2, 3, 4]),
                     "cost_ms": {str(t): c1 / t if ties else c1 / t ** r.uniform(0.5, 1.1)
                                 for t in tps}}
        if name != role:
            mod["role"] = role
        if not ties and r.random() < 0.5:
            mod.update(params=r.uniform(1e8, 4e9), activation_bytes_per_sample=r.uniform(1e8, 4e9),
                       frozen=r.random() < 0.2)
        mods[name] = mod
    data = {"gpus": r.randint(2, 32), "global_batch": bs, "gpus_per_node": r.choice([4, 8]),
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


def tiny_with(roles: dict[str, str]) -> dict:
    """tiny_cpu.json's modules re-used for ``roles`` (each copies its role's module)."""
    data = tiny()
    data["modules"] = {n: {**data["modules"][r], "role": r} for n, r in roles.items()}
    return data


# ----------------------------------------------------------------------- exactness


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("seed", range(30))
def test_optimum_equals_exhaustive_search_on_random_graph_instance(graph, seed):
    profile = graph_profile(GRAPHS[graph], seed)
    assert outcome(plan, profile) == outcome(exhaustive_plan, profile)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("seed", range(8))
def test_graph_tie_break_matches_exhaustive_search(graph, seed):
    profile = graph_profile(GRAPHS[graph], seed, ties=True)
    assert outcome(plan, profile) == outcome(exhaustive_plan, profile)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_random_graph_instances_are_mostly_feasible(graph):
    feasible = sum(not isinstance(outcome(plan, graph_profile(GRAPHS[graph], s)), str)
                   for s in range(30))
    assert feasible >= 20


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("seed", range(10))
def test_graph_plan_satisfies_every_constraint(graph, seed):
    profile = graph_profile(GRAPHS[graph], seed)
    try:
        result = plan(profile)
    except PlanError:
        pytest.skip("infeasible instance")
    assert tuple(result.modules) == profile.graph.names
    assert result.gpus == sum(m.gpus for m in result.modules.values()) <= profile.gpus
    d = result.llm.dp * profile.microbatch
    assert result.microbatches == profile.global_batch // d
    for name, m in result.modules.items():
        spec = profile.module(name)
        assert m.gpus == m.dp * m.tp * m.pp and d % m.dp == 0 and spec.layers % m.pp == 0
        assert m.samples_per_microbatch == (profile.microbatch if name == "llm" else d // m.dp)
        if profile.gpu_memory_gb is not None and m.memory_gib is not None:
            assert m.memory_gib <= profile.gpu_memory_gb
    assert t_iter(profile, result.degrees()).total_ms == result.t_iter_ms


# ----------------------------------------------------------------------- objective


def test_warm_up_follows_the_critical_path_and_steady_state_the_slowest_stage():
    roles = {"a": "encoder", "b": "encoder", "llm": "llm", "x": "generator", "y": "generator"}
    profile = profile_from_dict(tiny_with(roles) | {"global_batch": 8, "gpus": 64})
    # D = dp_llm * M = 2, K = 4; non-LLM modules take D / dp samples per step.
    layout = {"a": Degrees(1, 1, 1), "b": Degrees(2, 1, 2), "llm": Degrees(2, 2, 2),
              "x": Degrees(2, 1, 1), "y": Degrees(1, 2, 2)}
    c = {n: profile.module(n).cost_ms for n in roles}
    w = {"a": 2 * c["a"][1], "b": 1 * c["b"][1], "llm": 1 * c["llm"][2], "x": 1 * c["x"][1],
         "y": 2 * c["y"][2]}
    s = {n: w[n] / layout[n].pp for n in roles}
    got = t_iter(profile, layout)
    assert got.warmup_ms == w["llm"] + (max(w["a"], w["b"]) + max(w["x"], w["y"]))
    assert got.steady_ms == max(s.values()) * (4 - 1)
    assert got.total_ms == got.warmup_ms + got.steady_ms
    with pytest.raises(ValueError, match="does not divide"):
        t_iter(profile, layout | {"x": Degrees(4, 1, 1)})  # dp 4 does not divide D = 2


def test_three_module_objective_is_the_classic_formula_bit_for_bit():
    graph, r = ModuleGraph.default(), random.Random(5)
    for _ in range(500):
        w = {n: r.uniform(0.1, 1e4) for n in graph.names}
        s = {n: w[n] / r.randint(1, 80) for n in graph.names}
        k = r.randint(1, 2000)
        warm = w["llm"] + (w["encoder"] + w["generator"])
        steady = max(s["llm"], s["encoder"], s["generator"]) * (k - 1)
        assert tuple(combine(graph, w, s, k)) == (warm, steady, warm + steady)
        assert combine_arrays(graph, w, s, k) == warm + steady


@pytest.mark.parametrize("roles", [GRAPHS["no_generator"], GRAPHS["no_encoder"]])
def test_a_missing_role_adds_nothing_to_the_critical_path(roles):
    graph, w = ModuleGraph.from_roles(roles), {n: 3.0 * (i + 1) for i, n in enumerate(roles)}
    other = next(n for n in roles if n != "llm")
    assert combine(graph, w, w, 1).warmup_ms == w["llm"] + w[other]


# ----------------------------------------------------------------------- profiles


def test_roles_load_in_data_flow_order_and_round_trip_writing_only_new_roles():
    data = tiny_with({"llm": "llm", "speech": "generator", "vision": "encoder"})
    del data["modules"]["llm"]["role"]
    profile = profile_from_dict(data)
    assert profile.graph.names == ("vision", "llm", "speech") == tuple(profile.modules)
    out = profile_to_dict(profile)
    assert list(out["modules"]) == ["vision", "llm", "speech"]
    assert "role" not in out["modules"]["llm"] and out["modules"]["speech"]["role"] == "generator"
    assert profile_from_dict(json.loads(json.dumps(out))) == profile


def test_classic_profile_has_the_default_graph_and_writes_no_roles():
    profile = load_profile(EXAMPLES / "tiny_cpu.json")
    assert profile.graph == ModuleGraph.default()
    assert all("role" not in m for m in profile_to_dict(profile)["modules"].values())
    built = Profile(gpus=8, global_batch=8, modules={n: ModuleProfile(1, {1: 1.0})
                                                     for n in ("generator", "llm", "encoder")})
    assert built.graph == ModuleGraph.default() and tuple(built.modules) == built.graph.names


@pytest.mark.parametrize("mutate, field", [
    (lambda m: m.update(vision=dict(m["encoder"])), "modules.vision"),
    (lambda m: m["encoder"].update(role="decoder"), "modules.encoder.role"),
    (lambda m: m["generator"].update(role="llm"), "modules"),
    (lambda m: [m.pop("encoder"), m.pop("generator")], "modules"),
    (lambda m: m.update(Vision={**m["encoder"], "role": "encoder"}), "modules"),
    (lambda m: m.update(vision=[1]), "modules.vision"),
])
def test_bad_graph_in_profile_is_one_line_naming_field_and_file(tmp_path, mutate, field):
    data = tiny()
    mutate(data["modules"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"'{field}" in message


def test_profile_without_roles_for_new_names_is_refused_when_built_in_python():
    with pytest.raises(ProfileError, match="'modules.vision.role'"):
        Profile(gpus=8, global_batch=8, modules={"vision": ModuleProfile(1, {1: 1.0}),
                                                 "llm": ModuleProfile(1, {1: 1.0})})


# ----------------------------------------------------------------------- baselines, errors


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("seed", range(10))
def test_baselines_on_graphs_are_never_faster_than_the_optimum(graph, seed):
    profile = graph_profile(GRAPHS[graph], seed)
    try:
        best = plan(profile).t_iter_ms
    except PlanError:
        pytest.skip("infeasible instance")
    split = ratio_split(profile)
    assert set(split) == set(profile.graph.names) and min(split.values()) >= 1
    try:
        assert ratio_plan(profile).t_iter_ms >= best
    except PlanError:
        pass
    if len(profile.graph.encoders) > 1 or len(profile.graph.generators) > 1:
        return
    llm = profile.module("llm")
    for tp in llm.tp_degrees(profile.gpus_per_node):
        for pp in range(1, llm.layers + 1):
            if llm.layers % pp == 0:
                try:
                    assert megatron_plan(profile, tp=tp, pp=pp).t_iter_ms >= best
                except PlanError:
                    pass


@pytest.mark.parametrize("roles", [GRAPHS["no_generator"], GRAPHS["no_encoder"]])
def test_megatron_chain_without_a_role_is_one_stage_shorter(roles):
    profile = profile_from_dict(tiny_with(roles) | {"gpus": 40, "global_batch": 12})
    result = megatron_plan(profile, tp=2, pp=2)
    assert result.gpus == 6 * 2 * (2 + 1)  # dp 6: 6 * 6 <= 40 GPUs, 6 divides 12
    assert set(result.modules) == set(roles)
    layout = {n: Degrees(6, 2 if n == "llm" else 1, 2 if n == "llm" else 1) for n in roles}
    assert result.t_iter_ms == t_iter(profile, layout).total_ms


def test_megatron_refuses_parallel_encoders_in_one_line():
    profile = profile_from_dict(tiny_with(GRAPHS["two_encoders"]) | {"gpus": 40})
    with pytest.raises(PlanError, match="one pipeline chain") as info:
        megatron_plan(profile, tp=1, pp=1)
    assert "\n" not in str(info.value)


def test_too_few_gpus_on_a_graph_names_every_module():
    data = tiny_with(GRAPHS["two_encoders"]) | {"gpus": 3}
    with pytest.raises(PlanError) as info:
        plan(profile_from_dict(data))
    assert str(info.value) == \
        "needs at least 4 GPUs (image 1 + audio 1 + llm 1 + generator 1), profile has 3"


def test_gpu_caps_bound_every_module_of_a_graph():
    profile = profile_from_dict(tiny_with(GRAPHS["two_generators"]) | {"gpus": 24})
    caps = {"llm": 8, "image_gen": 2, "speech_gen": 4}
    result = plan(profile, gpu_caps=caps)
    assert all(result.module(n).gpus <= caps[n] for n in caps)
    assert build_plan(profile, result.degrees()) == result


# ----------------------------------------------------------------------- speed


def test_paper_scale_graph_with_parallel_modules_plans_every_module_within_the_gpus():
    """Its planning time is a benchmark's figure (``bench/bench_planner.py --encoders 2 --generators 2``)."""
    data = profile_to_dict(load_profile(EXAMPLES / "mllm_72b_1296gpus.json"))
    mods = data["modules"]
    enc, gen = mods["encoder"], mods["generator"]
    data["modules"] = {
        "vit": {**enc, "role": "encoder"},
        "audio": {**enc, "role": "encoder", "cost_ms": {t: 1.5 * c for t, c in enc["cost_ms"].items()}},
        "llm": mods["llm"],
        "sd": {**gen, "role": "generator"},
        "tts": {**gen, "role": "generator", "cost_ms": {t: 0.5 * c for t, c in gen["cost_ms"].items()}}}
    profile = profile_from_dict(data)
    result = plan(profile)
    assert result.gpus <= 1296 and set(result.modules) == {"vit", "audio", "llm", "sd", "tts"}

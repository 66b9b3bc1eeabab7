"""Plans the runtime accepts: legal degrees from the recipe's own validation, TP groups inside a
node, written recipes that load; and every plan says which costs were measured."""

from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path

import pytest
import yaml

from disttrain_ds.cli import plan as cli
from disttrain_ds.cost.profile import GIB, Profile
from disttrain_ds.cost.profile_file import load_profile, profile_from_dict
from disttrain_ds.graph import MODULES
from disttrain_ds.planner import optimize, recipe_plan
from disttrain_ds.planner.legal import restrict_to_runtime
from disttrain_ds.planner.optimize import Degrees, PlanError, exhaustive_plan, first_ranks, plan, tp_aligned
from disttrain_ds.planner.recipe_memory import fit_plan, runtime_peak, with_recipe_memory
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import find_recipe, load_recipe
from disttrain_ds.topology import Topology

EXAMPLES = Path(optimize.__file__).parent / "examples"
SHIPPED = {"tiny_cpu.json": "tiny_cpu", "mllm_9b_1296gpus.json": "mllm_9b",
           "mllm_72b_1296gpus.json": "mllm_72b"}


@pytest.fixture
def run(run_main):
    return functools.partial(run_main, cli.main)


def spanning_tp_groups(topo: Topology, gpus_per_node: int) -> list[tuple[str, list[int]]]:
    return [(m.name, g) for m in topo.modules for g in m.tp_groups()
            if len({r // gpus_per_node for r in g}) > 1]


def written_recipe_checks(path: Path, result: optimize.Plan, gpus_per_node: int) -> None:
    """The written recipe loads with the real loader, its rank map is the plan's, and no TP
    group spans two nodes of ``gpus_per_node``."""
    recipe = load_recipe(path)
    topo = topology_of(recipe)
    assert topo.world_size == result.gpus
    for m in topo.modules:
        assert (m.dp, m.tp, m.pp) == (result.module(m.name).dp, result.module(m.name).tp,
                                      result.module(m.name).pp)
    assert spanning_tp_groups(topo, gpus_per_node) == []


def runtime_fits(path: Path, limit_gib: float) -> bool:
    """Whether the runtime's start-up memory check (as ``--dry-run``) accepts the recipe at ``path``."""
    return runtime_peak(load_recipe(path)) <= limit_gib * GIB


@pytest.mark.parametrize("example", [pytest.param(e, marks=pytest.mark.slow) if "72b" in e else e for e in sorted(SHIPPED)])
def test_shipped_profile_writes_a_recipe_the_runtime_memory_check_accepts(run, tmp_path, example):
    out = tmp_path / "planned.yaml"
    profile_path = EXAMPLES / example
    code, stdout, err = run("--profile", str(profile_path), "--recipe", SHIPPED[example],
                            "--write-recipe", str(out), "--json")
    assert code == 0, err
    data = json.loads(stdout)
    profile = load_profile(profile_path)
    base = load_recipe(SHIPPED[example], ["layout=disaggregated"])
    legal = with_recipe_memory(restrict_to_runtime(profile, base)[0], base)
    limit = recipe_plan.runtime_limit(base, legal)
    expected = plan(legal) if limit is None else fit_plan(
        legal, plan, lambda p: recipe_plan.planned_recipe(find_recipe(SHIPPED[example]), p, False), limit)
    assert data == expected.to_json()
    written_recipe_checks(out, expected, profile.gpus_per_node)
    assert limit is None or runtime_fits(out, limit)
    assert "memory check would stop it" not in err and cli.memory_problem(out, profile) == ""


def test_72b_plan_from_the_profile_alone_is_refused_by_the_runtime_and_the_written_one_is_not(run, tmp_path):
    # Negative control: the paper-built 72B profile has no encoder activations and counts 1F1B's
    # microbatches in flight per module; its plan written into mllm_72b does not fit the runtime's
    # estimate (the worst-case sample's 8,192 patches at the head of the whole chain).
    profile = load_profile(EXAMPLES / "mllm_72b_1296gpus.json")
    base = load_recipe("mllm_72b", ["layout=disaggregated"])
    blind = plan(restrict_to_runtime(profile, base)[0])
    assert runtime_peak(recipe_plan.planned_recipe(find_recipe("mllm_72b"), blind, False)) > 80 * GIB
    out = tmp_path / "planned.yaml"
    code, _, err = run("--profile", str(EXAMPLES / "mllm_72b_1296gpus.json"), "--recipe", "mllm_72b",
                       "--write-recipe", str(out))
    assert code == 0 and "warning: " + str(out) not in err
    assert runtime_fits(out, 80)


def test_9b_plan_keeps_the_generator_at_a_tp_degree_its_heads_split():
    # The SD-2.1 U-Net's first attention_head_dim is 5: the runtime refuses TP > 1 there. Without
    # the recipe the profile alone allows TP=2, and a plan there is what training refused.
    profile = load_profile(EXAMPLES / "mllm_9b_1296gpus.json")
    assert plan(profile).module("generator").tp == 2
    legal, left = restrict_to_runtime(profile, load_recipe("mllm_9b"))
    assert plan(legal).module("generator").tp == 1
    assert {(x.module, x.tp) for x in left} == {("generator", 2), ("generator", 4), ("generator", 8)}
    assert all(x.key == "model.generator.attention_head_dim[0]" for x in left)


def test_72b_plan_starts_every_module_at_a_multiple_of_its_tp_degree():
    # The unaligned optimum put the encoder on 30 GPUs and the LLM's TP=4 groups on ranks 30-33.
    profile = load_profile(EXAMPLES / "mllm_72b_1296gpus.json")
    result = plan(profile)
    firsts = first_ranks(result.degrees(), profile.graph.names)
    assert result.module("llm").tp == 4 and firsts["llm"] % 4 == 0
    assert tp_aligned(result.degrees(), profile.graph.names)


def test_unaligned_layout_is_refused_by_the_alignment_rule():
    # Negative control for the check every plan passes.
    names = ("encoder", "llm", "generator")
    assert not tp_aligned({"encoder": Degrees(30, 1, 1), "llm": Degrees(60, 4, 5),
                           "generator": Degrees(60, 1, 1)}, names)
    assert tp_aligned({"encoder": Degrees(32, 1, 1), "llm": Degrees(60, 4, 5),
                       "generator": Degrees(60, 1, 1)}, names)


# --- random profiles against real recipes ---------------------------------------------------------

BASES = ("tiny_cpu", "mllm_9b")


@functools.lru_cache(maxsize=None)
def base_recipe(name: str):
    return load_recipe(name, ["layout=disaggregated"])


def random_runtime_profile(seed: int) -> tuple[Profile, str]:
    """A random three-module profile (any TP degrees, layer counts, GPUs per node, sources)
    planned for one of the shipped recipes."""
    r = random.Random(seed)
    bs = r.choice([1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 240, 480, 1920])
    mods = {}
    for name in MODULES:
        tps = sorted({1 if r.random() < 0.85 else r.choice([2, 4, 8])}
                     | set(r.sample([2, 4, 8], r.randint(0, 3))))
        c1 = r.uniform(5, 2000)
        mods[name] = {"layers": r.choice([1, 2, 3, 4, 6, 8, 12, 16, 32, 80]),
                      "cost_ms": {str(t): c1 / t ** r.uniform(0.3, 1.2) for t in tps},
                      "cost_source": {str(t): r.choice(["measured", "interpolated", "assumed"])
                                      for t in tps}}
    data = {"gpus": r.choice([r.randint(3, 64), r.randint(64, 1400)]), "global_batch": bs,
            "gpus_per_node": r.choice([2, 4, 8, 8, 8, 6, 16]),
            "microbatch": r.choice([m for m in (1, 2, 4) if bs % m == 0]), "modules": mods}
    return profile_from_dict(data, src=f"random-{seed}"), r.choice(BASES)


def planned_recipe_data(base: str, result: optimize.Plan, profile: Profile) -> dict:
    data = yaml.safe_load(find_recipe(base).read_text())
    data["train"].update(global_batch=profile.global_batch, micro_batch=profile.microbatch)
    return cli.recipe_with_plan(data, result, base)


@pytest.mark.parametrize("chunk", range(6))
def test_random_profiles_plan_recipes_that_load_with_tp_groups_inside_nodes(tmp_path, chunk):
    planned = 0
    for seed in range(chunk * 50, (chunk + 1) * 50):
        profile, base = random_runtime_profile(seed)
        try:
            result = plan(restrict_to_runtime(profile, base_recipe(base))[0])
        except PlanError:
            continue
        planned += 1
        assert tp_aligned(result.degrees(), profile.graph.names)
        out = tmp_path / f"{seed}.yaml"
        out.write_text(yaml.safe_dump(planned_recipe_data(base, result, profile), sort_keys=False))
        written_recipe_checks(out, result, profile.gpus_per_node)
    assert planned >= 30  # most instances are feasible, so the checks above ran


@pytest.mark.parametrize("seed", range(30))
def test_runtime_restricted_plan_equals_exhaustive_search(seed):
    r = random.Random(seed)
    profile, base = random_runtime_profile(seed)
    small = profile_from_dict({**json.loads(json.dumps(_as_dict(profile))),
                               "gpus": r.randint(3, 40), "global_batch": r.choice([4, 8, 12, 16])},
                              src=f"small-{seed}")
    def outcome(solver):
        try:
            return solver(restrict_to_runtime(small, base_recipe(base))[0]).to_json()
        except PlanError as exc:
            return f"PlanError: {exc}"
    assert outcome(plan) == outcome(exhaustive_plan)


def _as_dict(profile: Profile) -> dict:
    from disttrain_ds.cost.profile_file import profile_to_dict

    data = profile_to_dict(profile)
    data["microbatch"] = 1
    return data


# --- measured or declared -------------------------------------------------------------------------


def sourced_profile(tmp_path: Path, encoder_sources: dict[str, str], **top) -> Path:
    data = json.loads((EXAMPLES / "tiny_cpu.json").read_text())
    for name in ("llm", "generator"):
        data["modules"][name]["cost_source"] = {t: "measured" for t in data["modules"][name]["cost_ms"]}
    data["modules"]["encoder"]["cost_source"] = encoder_sources
    data.update(top)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_names_the_source_of_every_cost_and_warns_about_unmeasured_ones(run, tmp_path):
    path = sourced_profile(tmp_path, {"1": "measured", "2": "interpolated"})
    code, out, _ = run("--profile", str(path))
    assert code == 0
    assert plan(load_profile(path)).module("encoder").tp == 2
    assert "encoder:    TP=1 measured, TP=2* interpolated" in out
    assert "llm:        TP=1 measured, TP=2* measured, TP=4 measured" in out
    assert "warning: the predicted times rest on costs that were not measured: encoder TP=2 (interpolated)" in out
    code, out, _ = run("--profile", str(path), "--json")
    assert json.loads(out)["cost_source"] == {"encoder": "interpolated", "llm": "measured",
                                              "generator": "measured"}


def test_measured_only_plans_without_unmeasured_degrees(run, tmp_path):
    path = sourced_profile(tmp_path, {"1": "measured", "2": "interpolated"})
    code, out, err = run("--profile", str(path), "--measured-only", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["encoder"]["tp"] == 1 and set(data["cost_source"].values()) == {"measured"}


def test_measured_only_names_the_module_without_a_measured_cost(run, tmp_path):
    path = sourced_profile(tmp_path, {"2": "interpolated"})  # TP=1 undeclared: assumed
    code, out, err = run("--profile", str(path), "--measured-only")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--measured-only: encoder has no measured cost (TP=1 assumed, TP=2 interpolated)" in err


def test_measured_only_names_the_degree_a_feasible_plan_would_need(run, tmp_path):
    # The LLM (one layer, so no pipeline split) holds 16 GB of weights and gradients: at TP=1 it
    # does not fit in 12 GiB, and its TP=2 cost is interpolated.
    data = json.loads((EXAMPLES / "tiny_cpu.json").read_text())
    for mod in data["modules"].values():
        mod["cost_source"] = {t: "measured" for t in mod["cost_ms"]}
    llm = data["modules"]["llm"]
    llm.update(layers=1, cost_ms={"1": 40.0, "2": 22.0}, cost_source={"1": "measured", "2": "interpolated"},
               params=4e9, weight_bytes_per_param=2, grad_bytes_per_param=2, optimizer_bytes_per_param=0)
    data["gpu_memory_gb"] = 12
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code, out, err = run("--profile", str(path), "--measured-only")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--measured-only: nothing feasible with measured costs only" in err
    assert "the best plan needs llm TP=2, whose cost is interpolated" in err


def test_profile_whose_degrees_the_runtime_all_refuses_is_one_line_naming_why(tmp_path):
    data = json.loads((EXAMPLES / "tiny_cpu.json").read_text())
    data["modules"]["encoder"]["cost_ms"] = {"4": 3.0, "8": 2.0}  # tiny ViT: 2 heads
    with pytest.raises(PlanError, match=r"^encoder: the runtime refuses every TP degree of cost_ms "
                       r"\(4, 8\): TP=4 \(model.encoder.heads 2\)"):
        restrict_to_runtime(profile_from_dict(data, "p.json"), base_recipe("tiny_cpu"))


def test_cost_source_must_name_a_listed_degree_and_a_known_source(tmp_path):
    data = json.loads((EXAMPLES / "tiny_cpu.json").read_text())
    bad = copy.deepcopy(data)
    bad["modules"]["llm"]["cost_source"] = {"8": "measured"}
    with pytest.raises(Exception, match="'modules.llm.cost_source.8' names no degree"):
        profile_from_dict(bad, "p.json")
    bad = copy.deepcopy(data)
    bad["modules"]["llm"]["cost_source"] = {"2": "guessed"}
    with pytest.raises(Exception, match="'modules.llm.cost_source.2' must be one of measured"):
        profile_from_dict(bad, "p.json")


def test_when_only_the_node_rule_leaves_nothing_the_error_says_so_and_shows_the_unaligned_layout():
    # The LLM runs only at TP=4 on nodes of 4; the encoder (one layer, D = 1) takes 1 GPU, so the
    # LLM would start at rank 1.
    profile = profile_from_dict({"gpus": 6, "global_batch": 1, "gpus_per_node": 4, "modules": {
        "encoder": {"layers": 1, "cost_ms": {"1": 5.0}},
        "llm": {"layers": 1, "cost_ms": {"4": 10.0}},
        "generator": {"layers": 1, "cost_ms": {"1": 5.0}}}})
    with pytest.raises(PlanError, match=r"^no layout within 6 GPUs keeps every TP group inside a node of 4 GPUs "
                       r"\(each module must start at a multiple of its TP degree; the best layout without that "
                       r"rule is encoder 1x1x1 from rank 0, llm 1x4x1 from rank 1, generator 1x1x1 from rank 5\)$"):
        plan(profile)
    assert plan(profile, aligned=False).module("llm").tp == 4


@pytest.mark.parametrize("seed", range(8))
def test_random_profiles_under_a_memory_limit_write_recipes_the_runtime_memory_check_accepts(run, tmp_path, seed):
    # The tiny recipe's ranks need a few MiB: limits in that range make memory bind.
    r = random.Random(7000 + seed)
    profile, _ = random_runtime_profile(seed)
    data = _as_dict(profile)
    limit = r.uniform(0.003, 0.008)
    data.update(gpu_memory_gb=limit, global_batch=4, gpus=r.randint(8, 64))  # tiny_cpu's batch
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "planned.yaml"
    code, _, err = run("--profile", str(path), "--recipe", "tiny_cpu", "--write-recipe", str(out))
    if code != 0:
        assert not out.exists() and err.count("\n") == 1  # nothing fits: one line, nothing written
        return
    recipe = load_recipe(out)
    assert recipe.train.device_memory_gib <= 0  # tiny_cpu sets none: the profile's limit holds
    assert runtime_peak(recipe) <= limit * GIB

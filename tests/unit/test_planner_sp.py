"""Sequence parallelism as a degree of the orchestration search: SP costs and memory, the exact
search against brute force, and the recipe the planner writes (pure)."""

from __future__ import annotations

import random

import pytest
from test_planner import outcome, random_profile  # tests/unit is on sys.path under pytest

from disttrain_ds.cost.profile_file import ProfileError, profile_from_dict, profile_to_dict
from disttrain_ds.planner.optimize import PlanError, exhaustive_plan, plan


def with_sp(seed: int, overhead: float | None = None) -> dict:
    """A random instance whose LLM may run SP 2 or 4 (all-to-alls a share of its cost), its
    activations a large part of its memory."""
    r = random.Random(500 + seed)
    data = profile_to_dict(random_profile(seed))
    llm = data["modules"]["llm"]
    c1 = llm["cost_ms"]["1"]
    llm["sp_overhead_ms"] = {"2": (overhead if overhead is not None else r.uniform(0.02, 0.3)) * c1,
                             "4": (overhead if overhead is not None else r.uniform(0.05, 0.5)) * c1}
    llm["activation_bytes_per_sample"] = r.uniform(2, 12) * 2**30
    return data


@pytest.mark.parametrize("seed", range(24))
def test_search_with_sp_degrees_equals_exhaustive_search(seed):
    profile = profile_from_dict(with_sp(seed))
    assert outcome(plan, profile) == outcome(exhaustive_plan, profile)


def test_sp_is_chosen_where_and_only_where_it_pays():
    chose = [plan(profile_from_dict(with_sp(s))).llm.sp for s in range(24)
             if not isinstance(outcome(plan, profile_from_dict(with_sp(s))), str)]
    assert any(s > 1 for s in chose) and any(s == 1 for s in chose), chose
    # All-to-alls that cost more than the compute they split: never worth it.
    dear = [plan(profile_from_dict(with_sp(s, overhead=5.0))).llm.sp for s in range(24)
            if not isinstance(outcome(plan, profile_from_dict(with_sp(s, overhead=5.0))), str)]
    assert set(dear) == {1}


def test_sp_fits_an_llm_whose_sequences_do_not_fit_one_gpu():
    data = with_sp(3, overhead=0.1)
    data["gpu_memory_gb"] = 40.0
    data["gpus"] = 64
    llm = data["modules"]["llm"]
    llm["params"], llm["activation_bytes_per_sample"] = 1e8, 60 * 2**30  # one sample: 60 GiB of activations
    llm["layers"], llm["activation_tp_sharded"] = 1, 0.0  # neither PP nor TP splits them
    data["microbatch"] = 1
    with_it = plan(profile_from_dict(data))
    assert with_it.llm.sp >= 2 and with_it.llm.memory_gib <= 40.0
    llm["sp_overhead_ms"] = {}
    with pytest.raises(PlanError, match="llm: no layout fits"):
        plan(profile_from_dict(data))


def test_sp_degrees_respect_nodes_and_heads():
    data = with_sp(0)
    data["gpus_per_node"] = 4
    data["modules"]["llm"]["attention_heads"] = [8, 2]
    spec = profile_from_dict(data).modules["llm"]
    assert spec.sp_degrees(4, 1) == (1, 2, 4) and spec.sp_degrees(4, 2) == (1, 2) and spec.sp_degrees(4, 4) == (1,)
    data["modules"]["llm"]["attention_heads"] = [6, 6]
    assert profile_from_dict(data).modules["llm"].sp_degrees(4, 1) == (1, 2)  # 6 heads: not by 4


@pytest.mark.parametrize("field, value, words", [
    ("sp_overhead_ms", {"3": 1.0}, "is not an SP degree"),
    ("sp_overhead_ms", {"2": -1.0}, "must be >= 0"),
    ("sp_overhead_ms", [1.0], "must be an object"),
    ("attention_heads", [8, 3], "KV heads dividing them"),
])
def test_bad_sp_fields_are_one_line_errors(field, value, words):
    data = with_sp(0)
    data["modules"]["llm"][field] = value
    with pytest.raises(ProfileError) as e:
        profile_from_dict(data, src="p.json")
    assert "\n" not in str(e.value) and words in str(e.value) and f"modules.llm.{field}" in str(e.value)


def test_sp_fields_survive_a_round_trip_and_the_plan_says_sp():
    data = with_sp(3, overhead=0.1)
    data["modules"]["llm"]["attention_heads"] = [32, 8]
    profile = profile_from_dict(data)
    assert profile_from_dict(profile_to_dict(profile)) == profile
    found = next(plan(profile_from_dict(with_sp(s))) for s in range(24)
                 if not isinstance(outcome(plan, profile_from_dict(with_sp(s))), str)
                 and plan(profile_from_dict(with_sp(s))).llm.sp > 1)
    assert found.to_json()["llm"]["sp"] == found.llm.sp
    assert found.llm.gpus == found.llm.dp * found.llm.tp * found.llm.pp * found.llm.sp


def test_planned_recipe_runs_the_llm_with_the_sp_degree_the_search_chose(run_main, tmp_path):
    import json
    from pathlib import Path

    from disttrain_ds.cli import plan as cli
    from disttrain_ds.planner import optimize
    from disttrain_ds.recipe.graph import topology_of
    from disttrain_ds.recipe.schema import load_recipe

    data = json.loads((Path(optimize.__file__).parent / "examples" / "tiny_cpu.json").read_text())
    data["gpus"] = 12
    data["modules"]["llm"]["sp_overhead_ms"] = {"2": 1.0, "4": 3.0}  # cheap all-to-alls: SP pays
    (tmp_path / "p.json").write_text(json.dumps(data))
    code, out, err = run_main(cli.main, "--profile", str(tmp_path / "p.json"), "--recipe", "tiny_cpu",
                              "--write-recipe", str(tmp_path / "r.yaml"), "--json")
    assert code == 0, err
    chosen = json.loads(out)["llm"]
    assert chosen.get("sp", 1) > 1, chosen
    llm = topology_of(load_recipe(tmp_path / "r.yaml")).module("llm")
    assert (llm.dp, llm.tp, llm.pp, llm.sp) == (chosen["dp"], chosen["tp"], chosen["pp"], chosen["sp"])
    data["modules"]["llm"]["sp_overhead_ms"] = {"2": 1000.0, "4": 1000.0}  # dear all-to-alls: no SP
    (tmp_path / "q.json").write_text(json.dumps(data))
    code, out, err = run_main(cli.main, "--profile", str(tmp_path / "q.json"), "--recipe", "tiny_cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["llm"].get("sp", 1) == 1


def test_planned_recipe_splits_a_dominant_encoder_with_sp_within_its_heads(run_main, tmp_path):
    """An encoder whose samples dominate, its replicas capped by the LLM's slot: the search splits it
    with SP where all-to-alls are cheap (at most its 2 heads), not where they are dear."""
    import json
    from pathlib import Path

    from disttrain_ds.cli import plan as cli
    from disttrain_ds.planner import optimize
    from disttrain_ds.recipe.graph import topology_of
    from disttrain_ds.recipe.schema import load_recipe

    data = json.loads((Path(optimize.__file__).parent / "examples" / "tiny_cpu.json").read_text())
    data["gpus"] = 12
    data["modules"]["encoder"]["cost_ms"] = {"1": 400.0, "2": 390.0}
    data["modules"]["encoder"]["sp_overhead_ms"] = {"2": 1.0, "4": 3.0}  # the recipe's 2 heads allow SP 2 only
    (tmp_path / "p.json").write_text(json.dumps(data))
    code, out, err = run_main(cli.main, "--profile", str(tmp_path / "p.json"), "--recipe", "tiny_cpu",
                              "--write-recipe", str(tmp_path / "r.yaml"), "--json")
    assert code == 0, err
    chosen = json.loads(out)["encoder"]
    assert chosen.get("sp") == 2, chosen
    encoder = topology_of(load_recipe(tmp_path / "r.yaml")).module("encoder")
    assert (encoder.dp, encoder.tp, encoder.pp, encoder.sp) == (chosen["dp"], chosen["tp"], chosen["pp"], 2)
    data["modules"]["encoder"]["sp_overhead_ms"] = {"2": 1000.0, "4": 1000.0}
    (tmp_path / "q.json").write_text(json.dumps(data))
    code, out, err = run_main(cli.main, "--profile", str(tmp_path / "q.json"), "--recipe", "tiny_cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["encoder"].get("sp", 1) == 1


def with_auto(seed: int, tail: bool = True) -> dict:
    """``with_sp`` with a per-sample draw: the LLM's long-tailed (Pareto, a few samples many times
    the mean) or all equal; the other modules' mild."""
    import numpy as np

    data = with_sp(seed)
    rng = np.random.default_rng(seed)
    for name, m in data["modules"].items():
        x = (rng.pareto(1.3, 256) + 0.2 if tail else np.ones(256)) if name == "llm" else rng.uniform(0.5, 1.5, 256)
        m["sample_cost_ms"] = (x / x.mean() * m["cost_ms"]["1"]).tolist()
    data["modules"]["llm"]["attention_heads"] = [64, 8]
    return data


@pytest.mark.parametrize("seed", range(12))
def test_search_with_adaptive_groups_equals_exhaustive_search(seed):
    """``sp: auto`` (``AUTO_SP``) beside the fixed degrees: the closed form's optimum is brute force's."""
    profile = profile_from_dict(with_auto(seed))
    assert outcome(lambda p: plan(p, finalists=1), profile) == outcome(exhaustive_plan, profile)


def test_adaptive_groups_are_chosen_where_the_simulator_says_they_pay():
    """On long-tailed draws the planner takes adaptive groups for some instances, each simulated no
    slower than the best plan without them and some clearly faster; on equal costs never (groups
    of one rank are plain data parallelism, and SP 1 wins the tie)."""
    from disttrain_ds.cost.profile import AUTO_SP
    from disttrain_ds.planner.optimize import simulated_ms, without_auto

    gains = []
    for seed in range(8):
        profile = profile_from_dict(with_auto(seed))
        try:
            chosen = plan(profile)
        except PlanError:
            continue
        if chosen.llm.sp == AUTO_SP:
            other = plan(without_auto(profile))
            gains.append(other.t_sim_ms / chosen.t_sim_ms)
            assert simulated_ms(profile, chosen) == chosen.t_sim_ms
            assert chosen.llm.gpus == chosen.llm.dp * chosen.llm.tp * chosen.llm.pp
    assert gains and min(gains) >= 1.0 and max(gains) > 1.03, gains
    flat = []
    for seed in range(6):
        try:
            flat.append(plan(profile_from_dict(with_auto(seed, tail=False))).llm.sp)
        except PlanError:
            continue
    assert flat and AUTO_SP not in flat, flat


def test_adaptive_groups_need_a_draw_replicas_in_powers_of_two_and_heads_they_split():
    from dataclasses import replace

    spec = profile_from_dict(with_auto(0)).modules["llm"]
    assert spec.auto_sp(4, 1) and spec.auto_sp(2, 8)
    assert not spec.auto_sp(1, 1) and not spec.auto_sp(3, 1) and not spec.auto_sp(6, 1)
    assert not replace(spec, sample_cost_ms=None).auto_sp(4, 1)
    assert not replace(spec, attention_heads=(12, 4)).auto_sp(8, 1)  # 12 heads do not split over 8
    assert not replace(spec, sp_seq_len=4100).auto_sp(8, 1) and replace(spec, sp_seq_len=4096).auto_sp(8, 1)
    assert not replace(spec, adaptive=False).auto_sp(4, 1)


def test_adaptive_group_factors_match_sp1_on_equal_costs_and_beat_it_on_a_long_tail():
    """The straggler factor under adaptive groups: 1 where every sample costs the same (no group
    pays its all-to-alls), below SP 1's LPT factor where one sample in a step outweighs the rest."""
    from disttrain_ds.planner.hetero import StragglerTable

    flat = StragglerTable(profile_from_dict(with_auto(1, tail=False)))
    assert flat.auto_factor("llm", 4, 1, 1, 1) == pytest.approx(1.0)
    tail = StragglerTable(profile_from_dict(with_auto(1)))
    assert 1.0 <= tail.auto_factor("llm", 8, 1, 1, 1) < 0.9 * tail.factor("llm", 8, 1)
    assert tail.auto_factor("llm", 8, 1, 4, 1) >= tail.auto_factor("llm", 8, 1, 1, 1)  # pp steps in flight


def test_planned_recipe_runs_adaptive_groups_where_the_llm_draw_is_long_tailed(run_main, tmp_path):
    """One LLM sample in 8 twelve times the others: the plan gives the LLM ``sp: auto`` and the
    written recipe runs it; on equal costs it does not."""
    import json
    from pathlib import Path

    import numpy as np

    from disttrain_ds.cli import plan as cli
    from disttrain_ds.planner import optimize
    from disttrain_ds.recipe.graph import topology_of
    from disttrain_ds.recipe.schema import load_recipe

    data = json.loads((Path(optimize.__file__).parent / "examples" / "tiny_cpu.json").read_text())
    data["gpus"], data["global_batch"] = 12, 4
    data["modules"]["llm"]["sp_overhead_ms"] = {"2": 1.0, "4": 2.0}
    for tail, name in ((12.0, "p"), (1.0, "q")):
        x = np.ones(64)
        x[::8] = tail
        for module, m in data["modules"].items():
            cost = m["cost_ms"]["1"]
            m["sample_cost_ms"] = (x / x.mean() * cost if module == "llm" else np.full(64, cost)).tolist()
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        code, out, err = run_main(cli.main, "--profile", str(tmp_path / f"{name}.json"), "--recipe", "tiny_cpu",
                                  "--write-recipe", str(tmp_path / f"{name}.yaml"), "--json")
        assert code == 0, err
        chosen = json.loads(out)["llm"]
        llm = topology_of(load_recipe(tmp_path / f"{name}.yaml")).module("llm")
        assert (llm.dp, llm.tp, llm.pp) == (chosen["dp"], chosen["tp"], chosen["pp"])
        assert (chosen.get("sp") == "auto") == llm.sp_auto == (tail > 1), (tail, chosen)


@pytest.mark.parametrize("overrides, adaptive", [
    ([], True),
    (["emulate.enabled=true", "emulate.tflops=1"], False),  # emulated compute runs fixed degrees only
    (["data.read=host"], False),  # per-host reading keeps each sample on its host
])
def test_the_runtime_rules_decide_whether_adaptive_groups_are_offered(overrides, adaptive):
    import json
    from pathlib import Path

    from disttrain_ds.planner import optimize
    from disttrain_ds.planner.legal import restrict_to_runtime
    from disttrain_ds.recipe.schema import load_recipe

    data = json.loads((Path(optimize.__file__).parent / "examples" / "tiny_cpu.json").read_text())
    data["modules"]["llm"]["sp_overhead_ms"] = {"2": 1.0}
    for m in data["modules"].values():
        m["sample_cost_ms"] = [m["cost_ms"]["1"]] * 8
    recipe = load_recipe("tiny_cpu", ["layout=disaggregated", *overrides])
    llm = restrict_to_runtime(profile_from_dict(data), recipe)[0].modules["llm"]
    assert llm.adaptive is adaptive and llm.sp_seq_len == 128
    assert llm.auto_sp(4, 1) is adaptive and not llm.auto_sp(256, 1)  # 128-token rows do not split over 256

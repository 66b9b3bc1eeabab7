"""``python -m disttrain_ds.cli.plan``: JSON output, recipe writing, and one-line errors."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disttrain_ds.cli import plan as cli
from disttrain_ds.cost.profile_file import load_profile
from disttrain_ds.planner import optimize
from disttrain_ds.recipe.schema import find_recipe, load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = Path(optimize.__file__).parent / "examples" / "tiny_cpu.json"
MODULE_KEYS = {"gpus", "dp", "tp", "pp"}


@pytest.fixture
def run(run_main):
    return functools.partial(run_main, cli.main)


def assert_one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(cli.PROG + ": error: ")
    assert "Traceback" not in err
    return err


def test_json_output_is_one_object_with_exactly_the_plan_keys(run):
    code, out, err = run("--profile", str(TINY), "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"encoder", "llm", "generator", "t_iter_ms", "t_warmup_ms",
                         "t_steady_ms", "t_pred_ms", "cost_source"}
    assert data["cost_source"] == {"encoder": "assumed", "llm": "assumed", "generator": "assumed"}
    for name in ("encoder", "llm", "generator"):
        assert set(data[name]) == MODULE_KEYS
    assert data == optimize.plan(load_profile(TINY)).to_json()


def test_human_output_tabulates_every_module_and_the_times(run):
    code, out, _ = run("--profile", str(TINY))
    assert code == 0
    result = optimize.plan(load_profile(TINY))
    lines = out.splitlines()
    for name in ("encoder", "llm", "generator"):
        row = next(line.split() for line in lines if line.startswith(name + " "))
        m = result.module(name)
        assert row[1:5] == [str(m.gpus), str(m.dp), str(m.tp), str(m.pp)]
    assert f"{result.t_iter_ms:.1f} ms" in out and "T_warmup" in out and "T_steady" in out
    assert "predicted MFU" in out


def test_write_recipe_sets_layout_and_parallel_degrees_and_keeps_the_rest(run, tmp_path):
    base = yaml.safe_load(find_recipe("tiny_cpu").read_text())
    base["layout"] = "monolithic"
    base.setdefault("parallel", {})["llm"] = {"dp": 1, "tp": 1, "pp": 1, "partition": "parameters"}
    base["train"]["steps"] = 10
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    out_path = tmp_path / "out.yaml"
    code, out, _ = run("--profile", str(TINY), "--json", "--recipe",
                       str(tmp_path / "base.yaml"), "--write-recipe", str(out_path))
    assert code == 0
    plan = json.loads(out)
    written = yaml.safe_load(out_path.read_text())
    assert written["layout"] == "disaggregated"
    for name in ("encoder", "llm", "generator"):
        assert {k: written["parallel"][name][k] for k in ("dp", "tp", "pp")} == \
            {k: plan[name][k] for k in ("dp", "tp", "pp")}
    assert written["parallel"]["llm"]["partition"] == "parameters"
    assert written["model"] == base["model"] and written["train"] == base["train"]
    load_recipe(out_path)


def test_write_recipe_refuses_to_overwrite_unless_forced(run, tmp_path):
    (tmp_path / "base.yaml").write_text("train: {steps: 3}\n")
    target = tmp_path / "out.yaml"
    target.write_text("keep: me\n")
    args = ["--profile", str(TINY), "--recipe", str(tmp_path / "base.yaml"),
            "--write-recipe", str(target)]
    err = assert_one_line_error(*run(*args))
    assert "already exists" in err and str(target) in err
    assert target.read_text() == "keep: me\n"
    code, _, _ = run(*args, "--force")
    assert code == 0 and yaml.safe_load(target.read_text())["layout"] == "disaggregated"


def test_bad_profile_gives_one_line_naming_field_and_file(run, tmp_path):
    data = json.loads(TINY.read_text())
    del data["modules"]["llm"]["cost_ms"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    err = assert_one_line_error(*run("--profile", str(bad), "--json"))
    assert str(bad) in err and "'modules.llm.cost_ms'" in err


@pytest.mark.parametrize("which", ["profile", "recipe"])
def test_missing_input_file_gives_one_line_error(run, tmp_path, which):
    missing = tmp_path / "nope.yaml"
    args = ["--profile", str(missing if which == "profile" else TINY)]
    if which == "recipe":
        args += ["--recipe", str(missing), "--write-recipe", str(tmp_path / "out.yaml")]
    err = assert_one_line_error(*run(*args))
    assert str(missing) in err and "not found" in err
    assert not (tmp_path / "out.yaml").exists()


def test_infeasible_profile_reports_the_binding_constraint(run, tmp_path):
    data = json.loads(TINY.read_text())
    data["gpus"] = 2
    path = tmp_path / "small.json"
    path.write_text(json.dumps(data))
    err = assert_one_line_error(*run("--profile", str(path)))
    assert "needs at least 3 GPUs" in err


def test_write_recipe_without_base_recipe_is_a_usage_error(run, tmp_path):
    err = assert_one_line_error(*run("--profile", str(TINY), "--write-recipe",
                                     str(tmp_path / "o.yaml")))
    assert "--recipe" in err


def test_missing_required_argument_is_one_line(run):
    err = assert_one_line_error(*run("--json"))
    assert "--profile" in err


def test_module_entry_point_prints_only_json_on_stdout_and_fails_cleanly(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "disttrain_ds.cli.plan", "--profile", str(TINY),
                         "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0
    assert set(json.loads(ok.stdout)) >= {"encoder", "llm", "generator"}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    fail = subprocess.run([sys.executable, "-m", "disttrain_ds.cli.plan", "--profile", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert fail.returncode == 2 and fail.stdout == ""
    assert fail.stderr.count("\n") == 1 and "invalid JSON" in fail.stderr


def test_write_recipe_warns_when_recipe_batch_differs_from_profile(run, tmp_path):
    (tmp_path / "base.yaml").write_text("train: {global_batch: 3, micro_batch: 1}\n")
    code, _, err = run("--profile", str(TINY), "--recipe", str(tmp_path / "base.yaml"),
                       "--write-recipe", str(tmp_path / "out.yaml"))
    assert code == 0
    assert "warning" in err and "train.global_batch is 3" in err and "micro_batch" not in err
    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["train"]["global_batch"] == 3


def graph_profile_file(tmp_path: Path) -> Path:
    """tiny_cpu.json with a second, slower encoder (``audio``) beside the first."""
    data = json.loads(TINY.read_text())
    data["gpus"] = 12
    enc = data["modules"]["encoder"]
    data["modules"]["audio_encoder"] = {**enc, "role": "encoder",
                                        "cost_ms": {t: 2 * c for t, c in enc["cost_ms"].items()}}
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(data))
    return path


def test_graph_profile_plans_every_module_by_name(run, tmp_path):
    path = graph_profile_file(tmp_path)
    code, out, _ = run("--profile", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert list(data)[:4] == ["encoder", "audio_encoder", "llm", "generator"]
    assert data == optimize.plan(load_profile(path)).to_json()
    code, out, _ = run("--profile", str(path))
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for name in ("encoder", "audio_encoder", "llm", "generator"):
        assert rows[name][1:5] == [str(data[name][k]) for k in ("gpus", "dp", "tp", "pp")]
    assert "module graph: encoder -> llm, audio_encoder -> llm, llm -> generator" in out


def vlm_profile_file(tmp_path: Path, encoder: str = "vision") -> Path:
    """Understanding-only profile: ``encoder`` (role encoder) -> ``llm``, no generator, sized for
    tiny_vlm (its batch, its tiny modules' layers)."""
    data = {"gpus": 3, "global_batch": 4, "microbatch": 1, "gpus_per_node": 8,
            "modules": {encoder: {"role": "encoder", "layers": 2, "cost_ms": {"1": 12.0, "2": 7.0}},
                        "llm": {"layers": 4, "cost_ms": {"1": 40.0, "2": 22.0}}}}
    path = tmp_path / f"{encoder}_llm.json"
    path.write_text(json.dumps(data))
    return path


def test_write_recipe_for_a_module_graph_sets_parallel_modules_and_loads(run, tmp_path):
    path, out_path = vlm_profile_file(tmp_path), tmp_path / "vlm.yaml"
    code, out, err = run("--profile", str(path), "--json", "--recipe", "tiny_vlm",
                         "--write-recipe", str(out_path))
    assert code == 0 and "warning" not in err
    plan = json.loads(out)
    assert list(plan)[:2] == ["vision", "llm"]
    written = yaml.safe_load(out_path.read_text())
    base = yaml.safe_load(find_recipe("tiny_vlm").read_text())
    assert written["layout"] == "disaggregated"
    assert set(written["parallel"]) == {"modules"}
    assert list(written["parallel"]["modules"]) == ["vision", "llm"]
    assert written["model"] == base["model"] and written["train"] == base["train"]
    recipe = load_recipe(out_path)
    assert list(recipe.parallel.modules) == ["vision", "llm"]
    for name in ("vision", "llm"):
        mp = recipe.parallel.modules[name]
        assert (mp.dp, mp.tp, mp.pp) == tuple(plan[name][k] for k in ("dp", "tp", "pp"))
    assert recipe.layout == "disaggregated"


def test_three_module_profile_with_graph_form_base_writes_parallel_modules(run, tmp_path):
    base = yaml.safe_load(find_recipe("tiny_cpu").read_text())
    base["model"] = {"modules": {"encoder": {"family": "vit"}, "llm": {"family": "llama"},
                                 "generator": {"family": "unet"}}, "gen_loss_weight": 1.0}
    base["parallel"] = {"modules": {"llm": {"dp": 1, "pp": 2, "partition": "parameters"}}}
    base["train"]["global_batch"] = 8
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    out_path = tmp_path / "out.yaml"
    code, out, _ = run("--profile", str(TINY), "--json", "--recipe", str(tmp_path / "base.yaml"),
                       "--write-recipe", str(out_path))
    assert code == 0
    plan = json.loads(out)
    written = yaml.safe_load(out_path.read_text())
    assert set(written["parallel"]) == {"modules"}
    assert written["parallel"]["modules"]["llm"]["partition"] == "parameters"
    recipe = load_recipe(out_path)
    for name in ("encoder", "llm", "generator"):
        mp = recipe.parallel.modules[name]
        assert (mp.dp, mp.tp, mp.pp) == tuple(plan[name][k] for k in ("dp", "tp", "pp"))


def test_three_module_output_is_the_base_with_layout_and_degrees(run, tmp_path):
    out_path = tmp_path / "out.yaml"
    code, out, _ = run("--profile", str(TINY), "--json", "--recipe", "tiny_cpu",
                       "--write-recipe", str(out_path))
    assert code == 0
    plan = json.loads(out)
    want = yaml.safe_load(find_recipe("tiny_cpu").read_text())
    want["layout"] = "disaggregated"
    for name in ("encoder", "llm", "generator"):
        want["parallel"][name].update({k: plan[name][k] for k in ("dp", "tp", "pp")})
    assert out_path.read_text() == yaml.safe_dump(want, sort_keys=False)


@pytest.mark.parametrize("profile,recipe,recipe_list,profile_list", [
    ("vit", "tiny_vlm", "vision (encoder), llm (llm)", "vit (encoder), llm (llm)"),
    ("three", "tiny_vlm", "vision (encoder), llm (llm)",
     "encoder (encoder), llm (llm), generator (generator)"),
    ("vision", "tiny_cpu", "encoder (encoder), llm (llm), generator (generator)",
     "vision (encoder), llm (llm)"),
])
def test_write_recipe_with_mismatched_modules_names_both_lists(run, tmp_path, profile, recipe,
                                                               recipe_list, profile_list):
    path = TINY if profile == "three" else vlm_profile_file(tmp_path, profile)
    out_path = tmp_path / "out.yaml"
    err = assert_one_line_error(*run("--profile", str(path), "--recipe", recipe,
                                     "--write-recipe", str(out_path)))
    assert f"has {recipe_list} but the profile's modules are {profile_list}" in err
    assert recipe in err and not out_path.exists()


def _omni_profile(tmp_path: Path, encoders: tuple[str, ...] = ("vision", "ear")) -> Path:
    """Hand costs for a two-encoder graph sized like tiny_omni (one generator, ``painter``)."""
    mods = {n: {"role": "encoder", "layers": 2, "cost_ms": {"1": 10.0 + i}} for i, n in enumerate(encoders)}
    mods.update(llm={"layers": 2, "cost_ms": {"1": 40.0}}, painter={"role": "generator", "layers": 5, "cost_ms": {"1": 30.0}})
    path = tmp_path / "omni.json"
    path.write_text(json.dumps({"gpus": 6, "global_batch": 4, "microbatch": 1, "modules": mods}))
    return path


def test_write_recipe_for_two_encoders_writes_one_that_loads(run, tmp_path):
    out_path = tmp_path / "out.yaml"
    code, out, err = run("--profile", str(_omni_profile(tmp_path)), "--recipe", "tiny_omni", "--write-recipe", str(out_path))
    assert code == 0, err
    recipe = load_recipe(out_path)
    assert list(recipe.parallel.modules) == ["vision", "ear", "llm", "painter"] and recipe.layout == "disaggregated"


def test_write_recipe_refuses_what_the_runtime_refuses_by_the_runtimes_own_rule(run, tmp_path, monkeypatch):
    import disttrain_ds.recipe.checks as validate

    # Two encoders of one modality: the base recipe's families say so, and the plan refuses before writing.
    base = yaml.safe_load(find_recipe("tiny_omni").read_text())
    base["model"]["modules"]["ear"] = {"family": "vit", "preset": "tiny"}
    base["data"]["max_audio"] = 0
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    out_path = tmp_path / "out.yaml"
    err = assert_one_line_error(*run("--profile", str(_omni_profile(tmp_path)), "--recipe", str(tmp_path / "base.yaml"),
                                     "--write-recipe", str(out_path)))
    assert "one encoder per modality" in err and "plan without --write-recipe" in err and not out_path.exists()
    with pytest.raises(cli.ConfigError) as e:
        load_recipe(tmp_path / "base.yaml")
    assert validate.graph_problem(load_profile(_omni_profile(tmp_path)).graph, {"vision": "image", "ear": "image"}.get) \
        in str(e.value) and "one encoder per modality" in str(e.value)
    # One source of truth: whatever the runtime's rule says is what the plan says.
    monkeypatch.setattr(validate, "graph_problem", lambda graph, modality=None: "no graph today")
    err = assert_one_line_error(*run("--profile", str(_omni_profile(tmp_path)), "--recipe", "tiny_omni",
                                     "--write-recipe", str(out_path)))
    assert "no graph today" in err and not out_path.exists()
    with pytest.raises(cli.ConfigError, match="no graph today"):
        load_recipe("tiny_omni")


def test_graph_recipe_that_would_not_load_is_not_written(run, tmp_path):
    base = yaml.safe_load(find_recipe("tiny_vlm").read_text())
    base["deepspeed_config"] = "no_such_ds.json"
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    out_path = tmp_path / "out.yaml"
    out_path.write_text("keep: me\n")
    err = assert_one_line_error(*run("--profile", str(vlm_profile_file(tmp_path)), "--recipe",
                                     str(tmp_path / "base.yaml"), "--write-recipe", str(out_path),
                                     "--force"))
    assert "the base recipe must load" in err and "no_such_ds.json" in err and ".tmp" not in err
    assert out_path.read_text() == "keep: me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.yaml", "out.yaml", "vision_llm.json"]


def test_three_module_base_that_does_not_load_is_refused_and_nothing_written(run, tmp_path):
    (tmp_path / "base.yaml").write_text("model: {llm: llama3-7b}\n")
    err = assert_one_line_error(*run("--profile", str(TINY), "--recipe", str(tmp_path / "base.yaml"),
                                     "--write-recipe", str(tmp_path / "out.yaml")))
    assert "must load" in err and "'model.llm'" in err
    assert not (tmp_path / "out.yaml").exists()


def test_human_output_prints_straggler_factors_only_with_a_draw(run, tmp_path):
    code, out, _ = run("--profile", str(TINY))
    assert code == 0 and "straggler factors" not in out and "T_pred" in out
    data = json.loads(TINY.read_text())
    for i, mod in enumerate(data["modules"].values()):  # a skewed draw, same sample per entry
        mod["sample_cost_ms"] = [1.0, 1.0, 1.0, 9.0 + i]
    drawn = tmp_path / "drawn.json"
    drawn.write_text(json.dumps(data))
    code, out, _ = run("--profile", str(drawn))
    assert code == 0
    result = optimize.plan(load_profile(drawn))
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("straggler factors"))
    for name in ("encoder", "llm", "generator"):
        row = next(line.split() for line in lines[at:] if line.split()[:1] == [name])
        m = result.module(name)
        assert row[1:] == ["h", f"{m.straggler:.3f}", "g", f"{m.pace:.3f}"]
    assert f"{result.t_pred_ms:.1f} ms" in out

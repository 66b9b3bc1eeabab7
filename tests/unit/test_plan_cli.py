"""``python -m disttrain_ds.plan``: JSON output, recipe writing, and one-line errors."""

from __future__ import annotations

import functools

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disttrain_ds import plan as cli
from disttrain_ds.planner import optimize
from disttrain_ds.planner.profile import load_profile

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
                         "t_steady_ms"}
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
    base = {"model": {"llm": "llama3-7b", "seq_len": 8192}, "layout": "colocated",
            "parallel": {"llm": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 1}},
            "train": {"steps": 10, "lr": 3.0e-4}}
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
    assert written["parallel"]["llm"]["zero_stage"] == 1
    assert written["model"] == base["model"] and written["train"] == base["train"]


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
    ok = subprocess.run([sys.executable, "-m", "disttrain_ds.plan", "--profile", str(TINY),
                         "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0
    assert set(json.loads(ok.stdout)) >= {"encoder", "llm", "generator"}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    fail = subprocess.run([sys.executable, "-m", "disttrain_ds.plan", "--profile", str(bad)],
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


def test_write_recipe_for_a_module_graph_is_a_one_line_error(run, tmp_path):
    path = graph_profile_file(tmp_path)
    (tmp_path / "base.yaml").write_text("train: {steps: 3}\n")
    err = assert_one_line_error(*run("--profile", str(path), "--recipe",
                                     str(tmp_path / "base.yaml"), "--write-recipe",
                                     str(tmp_path / "out.yaml")))
    assert str(path) in err and "'modules'" in err and "graph section" in err
    assert not (tmp_path / "out.yaml").exists()
    with pytest.raises(cli.ConfigError, match="graph section"):
        cli.recipe_with_plan({}, optimize.plan(load_profile(path)))

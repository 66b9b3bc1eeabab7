"""What a ``pip install .`` without the checkout relies on: console commands, recipes found by name,
recipe paths resolved without the repository, and the shipped files inside the wheel."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from disttrain_ds.cli import train as train_cli
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import PACKAGE_DIR, RECIPES_DIR, find_recipe, load_recipe, shipped_recipes

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
COMMANDS = ("disttrain-train", "disttrain-plan", "disttrain-profile", "disttrain-launch", "disttrain-report",
            "disttrain-export")
SHIPPED = {"recipes": "*.yaml", "ds_configs": "*.json"}


def entry_point(command: str):
    module, func = PYPROJECT["project"]["scripts"][command].split(":")
    return getattr(importlib.import_module(module), func)


def config_error(*args) -> str:
    with pytest.raises(ConfigError) as exc:
        load_recipe(*args)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


# --- console commands ------------------------------------------------------------------------


def test_every_console_command_is_declared():
    assert set(PYPROJECT["project"]["scripts"]) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_console_command_help_exits_0_with_usage(command, run_main):
    code, out, err = run_main(entry_point(command), "--help")
    assert code == 0, err
    assert out.startswith("usage: ") and "--help" in out


def test_train_accepts_the_deepspeed_launchers_local_rank():
    args = train_cli.build_parser().parse_args(["--local_rank=3", "--recipe", "tiny_cpu", "train.steps=1"])
    assert args.recipe == "tiny_cpu" and args.overrides == ["train.steps=1"]


def test_train_sets_the_thread_default_and_reports_a_bad_recipe_in_one_line(monkeypatch, run_main):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    code, out, err = run_main(train_cli.main, "--recipe", "no_such_recipe")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: recipe 'no_such_recipe'")
    assert os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("argv", [
    ["tools/train.py", "--help"],
    ["tools/launch.py", "--help"],
    ["tools/report.py", "--help"],
    ["tools/export.py", "--help"],
    ["-m", "disttrain_ds.cli.train", "--help"],
    ["-m", "disttrain_ds.cli.plan", "--help"],
])
def test_checkout_wrappers_and_modules_still_run(argv):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ")


def test_plan_writes_a_recipe_from_a_shipped_recipe_name(tmp_path, run_main):
    from disttrain_ds.cli import plan

    profile = PACKAGE_DIR / "planner" / "examples" / "tiny_cpu.json"
    out = tmp_path / "planned.yaml"
    code, _, err = run_main(plan.main, "--profile", str(profile), "--write-recipe", str(out), "--recipe", "tiny_cpu")
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["layout"] == "disaggregated"


# --- recipes by name, paths inside recipes ---------------------------------------------------


def test_shipped_recipe_names_load_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ or ds_configs/ here
    assert {"tiny_cpu", "mllm_9b", "mllm_15b", "mllm_72b"} <= set(shipped_recipes())
    for name in shipped_recipes():
        assert find_recipe(name) == RECIPES_DIR / f"{name}.yaml"
    recipe = load_recipe("tiny_cpu", ["train.steps=2"])
    assert recipe.name == "tiny_cpu" and recipe.train.steps == 2
    assert Path(recipe.source_file) == RECIPES_DIR / "tiny_cpu.yaml"
    assert Path(recipe.deepspeed_config) == PACKAGE_DIR / "ds_configs" / "cpu_fp32.json"
    assert Path(load_recipe("mllm_9b").deepspeed_config) == PACKAGE_DIR / "ds_configs" / "zero1.json"


def test_paths_and_names_are_told_apart():
    assert find_recipe("recipes/tiny_cpu.yaml") == Path("recipes/tiny_cpu.yaml")
    assert find_recipe("elsewhere/tiny_cpu") == Path("elsewhere/tiny_cpu")
    assert find_recipe("mine.yaml") == Path("mine.yaml")  # a path even when missing


def test_unknown_recipe_name_is_one_line_listing_the_shipped_names():
    msg = config_error("tiny_gpu")
    assert "'tiny_gpu'" in msg and ", ".join(shipped_recipes()) in msg


def test_unresolvable_deepspeed_config_is_one_line_naming_the_key_and_places_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = config_error("tiny_cpu", ["deepspeed_config=ds_configs/gone.json"])
    assert "'deepspeed_config'" in msg and "ds_configs/gone.json" in msg
    for place in (RECIPES_DIR, tmp_path, PACKAGE_DIR):
        assert str(place / "ds_configs" / "gone.json") in msg, msg
    msg = config_error("tiny_cpu", ["parallel.llm.ds_config=nope.json"])
    assert "'parallel.llm.ds_config'" in msg and str(tmp_path / "nope.json") in msg


def test_recipe_paths_resolve_beside_the_recipe_before_the_working_directory(tmp_path, monkeypatch):
    home, work = tmp_path / "recipes", tmp_path / "work"
    home.mkdir(), work.mkdir()
    for d in (home, work):
        (d / "ds.json").write_text('{"steps_per_print": %d}' % (1 if d is home else 2))
    (work / "only_here.json").write_text("{}")
    recipe = dict(yaml.safe_load((RECIPES_DIR / "tiny_cpu.yaml").read_text()), deepspeed_config="ds.json")
    (home / "r.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(work)
    loaded = load_recipe(home / "r.yaml", ["parallel.encoder.ds_config=only_here.json"])
    assert loaded.deepspeed_config == str(home / "ds.json")  # absolute: every rank reads this file
    assert loaded.parallel.encoder.ds_config == str(work / "only_here.json")


# --- the shipped files in the package and the wheel ------------------------------------------


def test_root_folders_link_to_the_packaged_files():
    for folder in SHIPPED:
        assert (REPO / folder).is_symlink() and (REPO / folder).resolve() == PACKAGE_DIR / folder


def test_package_data_covers_every_shipped_file():
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["disttrain_ds"]
    for folder, pattern in SHIPPED.items():
        assert f"{folder}/{pattern}" in globs
        files = {p.name for p in (PACKAGE_DIR / folder).iterdir()}
        assert files and files == {p.name for p in (PACKAGE_DIR / folder).glob(pattern)}


def test_wheel_holds_the_recipes_ds_configs_and_console_commands(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "requirements.txt"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(PACKAGE_DIR, src / "disttrain_ds", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "out").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    for folder, pattern in SHIPPED.items():
        for path in (PACKAGE_DIR / folder).glob(pattern):
            assert f"disttrain_ds/{folder}/{path.name}" in names
    for command in COMMANDS:
        assert f"{command} = {PYPROJECT['project']['scripts'][command]}" in entry_points
    assert "Requires-Dist: torch==2.13.0" in metadata  # pins from requirements.txt

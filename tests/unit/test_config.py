"""Recipe and DeepSpeed-config validation: one-line errors naming the key and the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.deepspeed import load_ds_config
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path):
    r = load_recipe(path)
    assert r.name and r.train.steps >= 1


SHIPPED_DS_CONFIGS = sorted([*(REPO / "ds_configs").glob("*.json"), *(REPO / "disttrain_ds" / "ds_configs").glob("*.json")])


@pytest.mark.parametrize("path", SHIPPED_DS_CONFIGS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_every_shipped_ds_config_validates(path):
    cfg = load_ds_config(path)
    assert isinstance(cfg, dict)
    assert cfg.get("zero_optimization", {}).get("overlap_comm", False) is False


def test_overrides_change_nested_values_with_yaml_types():
    r = load_recipe(TINY, ["train.steps=3", "optim.lr=0.5", "layout=disaggregated", "logging.dir=/tmp/x"])
    assert (r.train.steps, r.optim.lr, r.layout, r.logging.dir) == (3, 0.5, "disaggregated", "/tmp/x")


def test_preset_fields_are_overridable():
    r = load_recipe(TINY, ["model.llm.layers=6"])
    assert r.model.llm.layers == 6 and r.model.llm.hidden_size == 64


def _error(overrides, path=TINY) -> str:
    with pytest.raises(ConfigError) as exc:
        load_recipe(path, overrides)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.stepz=3", ["unknown key 'train.stepz'", "tiny_cpu.yaml"]),
        ("bogus=1", ["unknown key 'bogus'"]),
        ("train.steps=many", ["'train.steps'", "integer"]),
        ("train.steps=0", ["'train.steps'", ">= 1"]),
        ("layout=pipeline", ["'layout'", "reference | monolithic | disaggregated"]),
        ("train.micro_batch=3", ["'train.global_batch'", "divisible"]),
        ("parallel.llm.pp=99", ["'parallel.llm.pp'", "exceeds"]),
        ("parallel.llm.tp=3", ["'parallel.llm.tp'"]),
        ("model.llm.preset=gpt5", ["'model.llm.preset'"]),
        ("data.image_sizes=[15]", ["'data.image_sizes'", "patch size"]),
        ("model.encoder.frozen=maybe", ["'model.encoder.frozen'", "true or false"]),
        ("deepspeed_config=ds_configs/missing.json", ["'deepspeed_config'", "not found"]),
        ("train.steps", ["key=value"]),
    ],
)
def test_bad_recipe_values_give_one_line_errors(override, words):
    msg = _error([override])
    for w in words:
        assert w in msg, msg


def test_encoder_dp_must_divide_llm_slot_in_disaggregated_layout():
    msg = _error(["layout=disaggregated", "parallel.encoder.dp=3"])
    assert "'parallel.encoder.dp'" in msg


@pytest.mark.parametrize("source", ["mmc4", "laion"])
def test_real_data_sources_need_data_path_and_never_fall_back(source):
    msg = _error([f"data.source={source}"])
    assert "'data.path'" in msg and f"data.source {source} reads" in msg and "set data.path to" in msg, msg


def test_real_data_source_loads_with_an_explicit_path(fixtures_dir):
    r = load_recipe(TINY, ["data.source=mmc4", f"data.path={fixtures_dir / 'mmc4_sample.jsonl'}"])
    assert r.data.source == "mmc4" and r.data.path.endswith("mmc4_sample.jsonl")


def test_missing_recipe_file_and_bad_yaml(tmp_path):
    assert "file not found" in _error([], tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    assert "invalid YAML" in _error([], bad)


def test_ds_config_rejects_unknown_and_recipe_owned_keys(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimisation": {"stage": 1}}))
    with pytest.raises(ConfigError, match="unknown DeepSpeed key 'zero_optimisation'"):
        load_ds_config(p)
    p.write_text(json.dumps({"train_batch_size": 8}))
    with pytest.raises(ConfigError, match="set by the recipe"):
        load_ds_config(p)
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="incompatible with pipeline"):
        load_ds_config(p)
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_ds_config(p)


def test_ds_config_refuses_overlap_comm_in_one_line_naming_file_and_key(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": True}}))
    with pytest.raises(ConfigError) as exc:
        load_ds_config(p)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{p}: zero_optimization.overlap_comm true")
    assert "parked boundary receives" in msg and "set it false" in msg
    p.write_text(json.dumps({"zero_optimization": {"stage": 0, "overlap_comm": "yes"}}))
    with pytest.raises(ConfigError, match="'zero_optimization.overlap_comm' must be true or false, got 'yes'"):
        load_ds_config(p)
    for off in ({"stage": 1, "overlap_comm": False}, {"stage": 1}):  # off, and DeepSpeed's default below ZeRO-3
        p.write_text(json.dumps({"zero_optimization": off}))
        assert load_ds_config(p)["zero_optimization"] == off


@pytest.mark.parametrize("key", ["deepspeed_config", "parallel.llm.ds_config"])
def test_recipe_load_refuses_overlap_comm_so_dry_runs_report_it(tmp_path, key):
    p = tmp_path / "overlap.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": True}}))
    msg = _error(["layout=disaggregated", f"{key}={p}"])
    assert str(p) in msg and "zero_optimization.overlap_comm true" in msg, msg


def test_recipe_with_bad_ds_config_names_it(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"fp17": {}}))
    msg = _error([f"deepspeed_config={p}"])
    assert "fp17" in msg and str(p) in msg


def test_cli_prints_one_line_error_and_exit_code_2(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "train.py"), "--recipe", str(TINY), "train.stepz=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "train.stepz" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["", "..", ".hidden", "../escape", "a/b", "/abs", "a b", "x" * 101, "caf\u00e9", "a\nb"])
def test_run_name_must_be_a_plain_name(name):
    msg = _error([f"name={name!r}" if name else "name=''"])
    assert "'name'" in msg and "plain name" in msg


@pytest.mark.parametrize("name", ["tiny_cpu", "run-2", "a.b", "x" * 100, "0"])
def test_plain_run_names_load(name):
    assert load_recipe(TINY, [f"name='{name}'"]).name == name

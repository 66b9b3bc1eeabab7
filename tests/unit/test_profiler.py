"""``python -m disttrain_ds.cli.profile``: real per-module measurements that the planner accepts."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disttrain_ds.cli import plan as plan_cli
from disttrain_ds.cli import profile as cli
from disttrain_ds.cost.profile_file import load_profile, profile_from_dict, profile_to_dict
from disttrain_ds.errors import ConfigError
from disttrain_ds.planner.optimize import plan
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"
FAST = ("--samples", "2", "--warmup", "1")


def run(*argv: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(cli.PROG + ": error: ") and "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, str]:
    """One CLI run on the tiny recipe with a 2-layer LLM: (profile path, stdout)."""
    path = tmp_path_factory.mktemp("profile") / "p.json"
    code, out, err = run("--recipe", TINY, "model.llm.layers=2", *FAST, "--out", path)
    assert code == 0, err
    return path, out


def test_profile_round_trips_and_plans(tiny, capsys):
    path, _ = tiny
    profile = load_profile(path)
    assert profile_from_dict(profile_to_dict(profile)) == profile
    assert json.loads(path.read_text()) == profile_to_dict(profile)
    recipe = load_recipe(TINY)
    assert (profile.global_batch, profile.microbatch) == (recipe.train.global_batch, recipe.train.micro_batch)
    assert profile.gpus == 4  # the recipe's layout: encoder 1 + LLM PP=2 + generator 1
    best = plan(profile)
    assert 3 <= best.gpus <= profile.gpus and best.t_iter_ms > 0
    assert plan_cli.main(["--profile", str(path)]) == 0
    assert "T_iter" in capsys.readouterr().out


def test_tp1_is_measured_larger_degrees_interpolated_and_unsplittable_ones_left_out(tiny):
    path, out = tiny
    profile = load_profile(path)
    # Tiny sizes: encoder 2 heads, LLM 2 KV heads, so TP 4 and 8 cannot split them (the runtime refuses).
    want = {"encoder": {1, 2}, "llm": {1, 2}, "generator": {1, 2, 4, 8}}
    for name, m in profile.modules.items():
        assert set(m.cost_ms) == want[name], name
        for t in set(m.cost_ms) - {1}:
            assert m.cost_ms[t] == pytest.approx(m.cost_ms[1] / (t * 0.9 ** math.log2(t)), rel=1e-12)
    assert "TP=1 measured" in profile.description
    assert "TP=2/4/8 interpolated, not measured" in profile.description
    assert "left out, sizes do not split: encoder TP=4 (model.encoder.heads)" in profile.description
    assert "llm TP=4 (model.llm.kv_heads)" in profile.description
    assert "interpolated, not measured" in out and "generator" in out


def test_cost_table_takes_measured_degrees_and_interpolates_the_rest():
    from disttrain_ds.profiler.tp import cost_table

    recipe = load_recipe(TINY)
    c1 = {"encoder": 10.0, "llm": 40.0, "generator": 20.0}
    measured = {2: {"encoder": 7.0, "llm": 30.0, "generator": 12.0}}
    costs, text = cost_table(recipe, c1, measured, 0.8, gpus_per_node=4)
    assert costs["llm"] == {1: 40.0, 2: 30.0}  # TP=4 does not split 2 KV heads
    # TP=4 scaled from the measured TP=2, not from TP=1; 8 > gpus_per_node.
    assert costs["generator"] == {1: 20.0, 2: 12.0, 4: pytest.approx(12.0 / (2 * 0.8))}
    assert "TP=2 measured" in text and "TP=4 interpolated" in text and "TP=8" not in text


def test_module_figures_come_from_the_real_model(tiny):
    from disttrain_ds.runtime.setup import build_data_and_spec

    path, out = tiny
    profile = load_profile(path)
    recipe = load_recipe(TINY, ["model.llm.layers=2"])
    source, spec = build_data_and_spec(recipe)
    source.close()
    for name, m in profile.modules.items():
        built = sum(p.numel() for d in spec.layers(name) for p in d.build().parameters())
        assert m.params == built
        assert m.activation_bytes_per_sample > 0 and m.flops_per_sample > 0 and not m.frozen
        assert m.weight_bytes_per_param == 4 and m.optimizer_bytes_per_param == 8  # fp32 AdamW
        row = next(line.split() for line in out.splitlines() if line.startswith(name + " "))
        assert row[1] == "train" and float(row[3]) == pytest.approx(m.cost_ms[1], abs=0.006)
    assert [profile.modules[n].layers for n in ("encoder", "llm", "generator")] == [2, 2, 5]


def test_timings_positive_and_a_deeper_llm_is_slower():
    opts = cli.Options(samples=3, warmup=1)
    small = cli.profile_recipe(load_recipe(TINY, ["model.llm.layers=2"]), opts)
    large = cli.profile_recipe(load_recipe(TINY, ["model.llm.layers=8"]), opts)
    for r in small + large:
        assert len(r.times_ms) == 3 and min(r.times_ms) > 0 and r.median_ms <= r.p90_ms <= max(r.times_ms)
    assert large[1].median_ms > small[1].median_ms
    assert large[1].params > small[1].params and large[1].flops[0] > small[1].flops[0]


def test_frozen_modules_are_flagged_and_timed_as_such(tmp_path):
    path = tmp_path / "frozen.json"
    code, _, err = run("--recipe", TINY, "model.encoder.frozen=true", "model.encoder.projector.frozen=true", *FAST,
                       "--out", path)
    assert code == 0, err
    modules = json.loads(path.read_text())["modules"]
    assert modules["encoder"]["frozen"] is True
    assert "activation_bytes_per_sample" not in modules["encoder"]  # forward only: 0, left at the default
    assert "frozen" not in modules["llm"] and modules["llm"]["activation_bytes_per_sample"] > 0
    plan(load_profile(path))
    # A frozen LLM behind a trained encoder still passes gradients through (forward + input grad).
    results = cli.profile_recipe(load_recipe(TINY, ["model.llm.frozen=true"]), cli.Options(samples=1, warmup=0))
    assert [r.mode for r in results] == ["train", "frozen_passthrough", "train"]
    assert results[1].activation_bytes > 0


def test_refuses_to_overwrite_unless_forced(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("keep me\n")
    err = assert_one_line_error(*run("--recipe", TINY, *FAST, "--out", path))
    assert "already exists (use --force to overwrite)" in err
    assert path.read_text() == "keep me\n"
    code, _, err = run("--recipe", TINY, "--samples", "1", "--warmup", "0", "--out", path, "--force")
    assert code == 0, err
    assert load_profile(path).modules["llm"].cost_ms[1] > 0


@pytest.mark.parametrize("argv, message", [
    (("model.llm.layerz=3",), "layerz"),
    (("--samples", "0"), "--samples must be >= 1, got 0"),
    (("--tp-efficiency", "1.5"), "--tp-efficiency must be <= 1"),
    (("--measure-tp", "3"), "--measure-tp: 3 is not one of 2, 4, 8"),
    (("--measure-tp", "8", "--gpus-per-node", "4"), "--measure-tp: 8 is above --gpus-per-node 4"),
])
def test_bad_arguments_give_one_line(tmp_path, argv, message):
    err = assert_one_line_error(*run("--recipe", TINY, *argv, "--out", tmp_path / "p.json"))
    assert message in err
    assert not (tmp_path / "p.json").exists()


def test_bad_recipe_is_one_line_and_exit_2_from_the_command_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "disttrain_ds.cli.profile", "--recipe", str(tmp_path / "nope.yaml"),
                           "--out", str(tmp_path / "p.json")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    err = assert_one_line_error(proc.returncode, proc.stdout, proc.stderr)
    assert "nope.yaml: file not found" in err


@pytest.mark.gpu
def test_cuda_path_times_with_events_and_reports_peak_memory():
    opts = cli.Options(samples=2, warmup=1, device=torch.device("cuda"))
    for r in cli.profile_recipe(load_recipe(TINY), opts):
        assert min(r.times_ms) > 0 and r.memory_bytes >= r.params * 4


def test_profile_carries_a_draw_from_the_runtimes_cost_model_scaled_to_the_tp1_cost(tiny):
    path, _ = tiny
    data = json.loads(path.read_text())
    draws = {n: m["sample_cost_ms"] for n, m in data["modules"].items()}
    assert {len(d) for d in draws.values()} == {int(FAST[1])}  # one entry per timed sample
    for name, draw in draws.items():
        assert sum(draw) / len(draw) == pytest.approx(data["modules"][name]["cost_ms"]["1"], rel=1e-9)
    assert "sample_cost_ms: the 2 samples' cost-model FLOPs" in data["description"]
    # Proportional to the runtime's cost model over the timed samples (global batch 0).
    from dataclasses import replace

    from disttrain_ds.runtime.emulate import patch_size, sample_flops
    from disttrain_ds.runtime.setup import build_data_and_spec, cost_model

    recipe = load_recipe(TINY, ["model.llm.layers=2"])
    source, spec = build_data_and_spec(replace(recipe, train=replace(recipe.train, global_batch=2)))
    try:
        samples = source.global_batch(0)
    finally:
        source.close()
    for name, draw in draws.items():
        work = [sample_flops(cost_model(recipe), name, x, patch_size(recipe, name), spec.special)
                for x in samples]
        assert [d / draw[0] for d in draw] == pytest.approx([w / work[0] for w in work], rel=1e-9)


def test_a_sample_without_work_in_a_module_keeps_its_zero_in_the_draw():
    ok = cli.ModuleResult("llm", "train", 2, 10, [5.0, 7.0], [9.0, 9.0], 0, 0.0, "llm", work=[2.0, 6.0])
    empty = cli.ModuleResult("encoder", "train", 2, 10, [1.0, 1.0], [1.0, 3.0], 0, 0.0, "encoder", work=[0.0, 3.0])
    idle = cli.ModuleResult("gen", "train", 2, 10, [1.0, 1.0], [1.0, 3.0], 0, 0.0, "gen", work=[0.0, 0.0])
    costs = {"llm": {1: 8.0}, "encoder": {1: 2.0}, "gen": {1: 5.0}}
    assert cli.sample_draws([ok], costs) == {"llm": (4.0, 12.0)}
    assert cli.sample_draws([ok, empty, idle], costs) == {"llm": (4.0, 12.0), "encoder": (0.0, 4.0), "gen": (0.0, 0.0)}
    # A module that timed no sample has no draw at all.
    untimed = cli.ModuleResult("x", "train", 2, 10, [1.0], [1.0], 0, 0.0, "x", work=[])
    assert cli.sample_draws([ok, untimed], {**costs, "x": {1: 1.0}}) is None


def test_the_draw_follows_the_runtimes_cost_model_not_the_useful_flops():
    # Packed sequences of one length: useful FLOPs vary with their padding, the work does not.
    llm = cli.ModuleResult("llm", "train", 2, 10, [5.0, 7.0], [1.0, 3.0], 0, 0.0, "llm", work=[4.0, 4.0])
    assert cli.sample_draws([llm], {"llm": {1: 8.0}}) == {"llm": (8.0, 8.0)}


def test_profile_carries_the_recipes_activation_checkpointing_for_the_memory_model():
    from disttrain_ds.cli.profile import checkpointing_fields
    from disttrain_ds.estimate.activations import module_layers
    from disttrain_ds.estimate.memory import vocab_size
    from disttrain_ds.recipe.schema import load_recipe

    plain = load_recipe("tiny_cpu")
    assert checkpointing_fields(plain, "llm") == {}
    recipe = load_recipe("tiny_cpu", ["parallel.llm.activation_checkpointing=2"])
    fields = checkpointing_fields(recipe, "llm")
    assert fields["activation_checkpointing"] == 2
    assert fields["layer_output_bytes_per_sample"] == max(module_layers(recipe, "llm", vocab_size(recipe)).outputs) > 0
    assert checkpointing_fields(recipe, "encoder") == {}


# --------------------------------------------------------------------------- module graphs

T2I = """\
name: tiny_t2i
seed: 1234
model:
  modules:
    llm: {family: llama, preset: tiny, layers: 2}
    painter: {family: unet, preset: tiny}
data: {source: synthetic, tokenizer: byte, seq_len: 64, max_images: 0, image_sizes: [16]}
train: {steps: 2, global_batch: 2, micro_batch: 1}
deepspeed_config: ds_configs/cpu_fp32.json
"""


def test_a_graph_recipe_is_profiled_by_module_name_and_planned_into_a_recipe_that_loads(tmp_path, capsys):
    path, written = tmp_path / "vlm.json", tmp_path / "planned.yaml"
    code, out, err = run("--recipe", "tiny_vlm", *FAST, "--out", path)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert list(data["modules"]) == ["vision", "llm"] and data["modules"]["vision"]["role"] == "encoder"
    assert "generator" not in out and out.splitlines()[1].startswith("vision")
    profile = load_profile(path)
    assert profile.graph.encoders == ("vision",) and profile.gpus == 3  # the recipe's vision 1 + LLM PP=2
    for name, m in profile.modules.items():  # a draw per module, averaging to its cost
        assert m.cost_ms[1] > 0 and len(m.sample_cost_ms) == 2
        assert sum(m.sample_cost_ms) / 2 == pytest.approx(m.cost_ms[1], rel=1e-9)
    assert plan_cli.main(["--profile", str(path), "--recipe", "tiny_vlm", "--write-recipe", str(written)]) == 0
    capsys.readouterr()
    planned = load_recipe(written)
    assert tuple(planned.model.modules) == ("vision", "llm") and planned.layout == "disaggregated"
    assert sum(m.dp * m.tp * m.pp for m in planned.parallel.modules.values()) <= profile.gpus


def test_a_generation_only_graph_times_its_generator_on_the_llm_states(tmp_path):
    from disttrain_ds.profiler.measure import Options, modes, profile_recipe

    recipe_path = tmp_path / "t2i.yaml"
    recipe_path.write_text(T2I)
    recipe = load_recipe(recipe_path)
    results = profile_recipe(recipe, Options(samples=1, warmup=0))
    assert [(r.name, r.role, r.mode) for r in results] == [("llm", "llm", "train"), ("painter", "generator", "train")]
    assert all(r.times_ms[0] > 0 and r.flops[0] > 0 for r in results)
    frozen = load_recipe(recipe_path, ["model.modules.llm.frozen=true"])
    assert modes(frozen) == {"llm": ("frozen", False), "painter": ("train", False)}
    frozen_gen = load_recipe(recipe_path, ["model.modules.painter.frozen=true",
                                           "model.modules.painter.projector.frozen=true"])
    assert modes(frozen_gen)["painter"] == ("frozen_passthrough", True)


def test_an_image_and_audio_graph_is_profiled_and_planned_into_a_recipe_that_loads(tmp_path, capsys):
    import statistics
    from dataclasses import replace

    from disttrain_ds.metrics.step_flops import StepFlopsCounter
    from disttrain_ds.runtime.setup import build_data_and_spec

    path, written = tmp_path / "omni.json", tmp_path / "planned.yaml"
    code, out, err = run("--recipe", "tiny_omni", *FAST, "--out", path)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert list(data["modules"]) == ["vision", "ear", "llm", "painter"]
    assert data["modules"]["ear"]["role"] == "encoder" and data["modules"]["ear"]["cost_ms"]["1"] > 0
    profile = load_profile(path)
    assert profile.graph.encoders == ("vision", "ear") and profile.gpus == 5
    # The audio encoder's FLOPs are its family's for the timed clips, as the training MFU counts them.
    recipe = load_recipe("tiny_omni")
    source, spec = build_data_and_spec(replace(recipe, train=replace(recipe.train, global_batch=2)))
    samples = source.global_batch(0)
    source.close()
    per_sample = [StepFlopsCounter(spec).module("ear", [s]) for s in samples]
    assert data["modules"]["ear"]["flops_per_sample"] == pytest.approx(statistics.median(per_sample), rel=1e-9)
    for name, m in profile.modules.items():  # a draw per module, averaging to its cost
        assert len(m.sample_cost_ms) == 2 and sum(m.sample_cost_ms) / 2 == pytest.approx(m.cost_ms[1], rel=1e-9)
    assert plan_cli.main(["--profile", str(path), "--recipe", "tiny_omni", "--write-recipe", str(written)]) == 0
    capsys.readouterr()
    planned = load_recipe(written)
    assert tuple(planned.parallel.modules) == ("vision", "ear", "llm", "painter") and planned.layout == "disaggregated"
    assert sum(m.dp * m.tp * m.pp for m in planned.parallel.modules.values()) <= profile.gpus


def test_a_failed_tp_worker_is_reported_by_its_own_exception_not_torchruns_summary():
    from disttrain_ds.profiler.tp import worker_error

    output = ("[rank1]: Traceback (most recent call last):\n"
              "[rank1]:   File \"x.py\", line 3, in <module>\n"
              "[rank1]: RuntimeError: Connection closed by peer\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "  error_file: <N/A>\n"
              "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert worker_error(output) == "[rank1]: RuntimeError: Connection closed by peer"
    assert worker_error("") == "no output"


def test_a_draw_from_the_data_prices_many_samples_at_the_timed_ms_per_unit_of_work():
    ok = cli.ModuleResult("llm", "train", 2, 10, [5.0, 7.0], [9.0, 9.0], 0, 0.0, "llm", work=[2.0, 6.0])
    idle = cli.ModuleResult("gen", "train", 2, 10, [1.0, 1.0], [1.0, 3.0], 0, 0.0, "gen", work=[0.0, 0.0])
    costs = {"llm": {1: 8.0}, "gen": {1: 5.0}}
    # The timed samples cost 8 ms for 4 units on average: 2 ms per unit, for every sample of the data.
    assert cli.sample_draws([ok], costs, {"llm": [2.0, 4.0, 0.0, 1.0]}) == {"llm": (4.0, 8.0, 0.0, 2.0)}
    assert cli.sample_draws([idle], costs, {"gen": [0.0, 0.0, 0.0]}) == {"gen": (0.0, 0.0, 0.0)}
    with pytest.raises(ConfigError, match="--draw-from: no timed sample gave module gen work"):
        cli.sample_draws([ok, idle], costs, {"llm": [1.0], "gen": [3.0]})


def test_draw_from_reads_that_many_samples_of_the_recipes_data(tmp_path):
    from disttrain_ds.runtime.emulate import data_work

    path = tmp_path / "p.json"
    code, _, err = run("--recipe", TINY, "model.llm.layers=2", *FAST, "--draw-from", "6", "--out", path)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert "the first 6 samples of the recipe's data" in data["description"]
    work, unit_work = data_work(load_recipe(TINY, ["model.llm.layers=2"]), 6)
    for name, m in data["modules"].items():
        draw = m["sample_cost_ms"]
        assert len(draw) == 6 and len(work[name]) == 6
        ratio = [d / w for d, w in zip(draw, work[name]) if w > 0]
        assert ratio and max(ratio) == pytest.approx(min(ratio), rel=1e-9)  # one ms per unit of work
        # Encoders and generators split each sample's ms over its units (images, target images).
        if name == "llm":
            assert "unit_cost_ms" not in m
            continue
        units = m["unit_cost_ms"]
        assert [sum(u) for u in units] == pytest.approx(draw, rel=1e-9, abs=1e-12)
        assert [len(u) for u in units] == [len(u) for u in unit_work[name]] and sum(map(len, units)) > 0
        flat = [(ms, w) for u, uw in zip(units, unit_work[name]) for ms, w in zip(u, uw) if w > 0]
        assert max(ms / w for ms, w in flat) == pytest.approx(min(ms / w for ms, w in flat), rel=1e-9)
    code, out, err = run("--recipe", TINY, *FAST, "--draw-from", "0", "--out", tmp_path / "q.json")
    assert "--draw-from must be >= 1" in assert_one_line_error(code, out, err)


def test_sp_fields_price_an_encoders_median_rows_and_skip_modules_without_an_sp_path():
    from disttrain_ds.profiler.measure import ModuleResult

    recipe = load_recipe(TINY)

    def result(name: str, role: str, rows: list[int]) -> ModuleResult:
        return ModuleResult(name, "train", 2, 1, [1.0], [1.0], 0, 0.0, role, rows=rows)

    one = cli.sp_fields(recipe, result("encoder", "encoder", [10, 30, 20]), 8)
    two = cli.sp_fields(recipe, result("encoder", "encoder", [40, 40, 5]), 8)
    assert one["attention_heads"] == (2, 2) and sorted(one["sp_overhead_ms"]) == [2, 4, 8]
    assert all(two["sp_overhead_ms"][s] == pytest.approx(2 * one["sp_overhead_ms"][s]) for s in (2, 4, 8))
    assert sorted(cli.sp_fields(recipe, result("encoder", "encoder", [10]), 4)["sp_overhead_ms"]) == [2, 4]
    assert cli.sp_fields(recipe, result("encoder", "encoder", [0, 0]), 8) == {}  # read no items
    assert cli.sp_fields(recipe, result("generator", "generator", []), 8) == {}  # U-Net: no SP path
    assert cli.sp_fields(recipe, result("llm", "llm", []), 8)["attention_heads"] == (4, 2)

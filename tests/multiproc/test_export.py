"""Export and weights-only starts from checkpoints that DeepSpeed engines wrote: encoder TP=2, LLM
TP=2 x PP=2 (7 ranks) under the NCCL emulation. The exported directories load with
``from_pretrained`` and compute what the trained modules compute; a weights-only start
(``train.init_from``) trains to the reference's losses from those weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from export_checks import output_diff

from .conftest import launch, metrics_steps

MODULES = ("encoder", "llm", "generator")
TP_PP = ["layout=disaggregated", "parallel.encoder.tp=2", "parallel.llm.tp=2", "parallel.llm.pp=2"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(step directory written by a TP=2 / PP=2 run after 2 steps, that run's final parameters)."""
    out = tmp_path_factory.mktemp("tp_pp")
    _, params, _ = launch(out, 7, [*TP_PP, "train.steps=2", "checkpoint.every=2", f"checkpoint.dir={out / 'ck'}"])
    return out / "ck" / "step_00000002", params


def _module_state(params: dict, module: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: v for k, v in params.items() if k.startswith(module + "/")}


def test_export_of_a_tp_pp_checkpoint_loads_with_from_pretrained_and_matches_the_trained_modules(trained, tmp_path):
    from disttrain_ds.checkpoint.export import export_checkpoint
    from disttrain_ds.checkpoint.read import read_module_state, step_recipe, verified_manifest
    from disttrain_ds.mllm.recipe_spec import meta_spec

    step, params = trained
    recipe = step_recipe(verified_manifest(step, "llm"))
    spec = meta_spec(recipe, params["llm/embed/embed_tokens.weight"].shape[0])
    out = export_checkpoint(step, tmp_path / "exported", log=lambda line: None)
    for m in MODULES:
        state = _module_state(params, m)
        got = read_module_state(step, m)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state), m
        assert output_diff(spec, m, state, out / m) <= 1e-5, m
    # Negative control: the same check against the generator's untrained init fails.
    init = {f"{d.name}/{k}": v for d in spec.layers("generator") for k, v in d.build().state_dict().items()}
    assert output_diff(spec, "generator", init, out / "generator") > 1e-4


def test_exported_and_step_directories_import_to_the_trained_tensors(trained, tmp_path):
    from disttrain_ds.checkpoint.export import export_checkpoint
    from disttrain_ds.checkpoint.read import STEP_DIRS
    from disttrain_ds.estimate.memory import vocab_size
    from disttrain_ds.mllm.recipe_spec import meta_spec
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.imports import check_imports

    step, params = trained
    out = export_checkpoint(step, tmp_path / "exported", log=lambda line: None)
    for source in (lambda m: out / m, lambda m: step):
        recipe = load_recipe("tiny_cpu", [f"model.{m}.checkpoint={source(m)}" for m in MODULES])
        check_imports(recipe)
        spec = meta_spec(recipe, vocab_size(recipe))
        configs = {"encoder": recipe.model.encoder, "generator": recipe.model.generator,
                   "llm": dataclasses.replace(recipe.model.llm, vocab_size=spec.llm.vocab_size)}
        spec = dataclasses.replace(spec, configs={n: configs[n] for n in spec.names},
                                   step_dirs=STEP_DIRS)  # the runtime's reader of step directories
        for m in MODULES:
            for d in spec.layers(m):
                for k, v in d.build().state_dict().items():
                    assert torch.equal(v, params[f"{m}/{d.name}/{k}"]), (m, d.name, k)


def test_init_from_a_step_directory_trains_the_reference_losses_from_its_weights(trained, tmp_path, reference_run):
    step, _ = trained
    start = [f"train.init_from={step}", "train.steps=2"]
    rows, _, _ = launch(tmp_path / "run", 4, ["layout=disaggregated", *start, "checkpoint.every=1",
                                               f"checkpoint.dir={tmp_path / 'ck'}"])
    assert [r["step"] for r in rows] == [1, 2]  # step 0: a new run, not a resumed one
    ref, _ = reference_run(start)
    fresh, _ = reference_run(["train.steps=2"])
    losses = [r["loss"] for r in rows]
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-5, (losses, ref)
    assert abs(losses[0] - fresh[0]) > 1e-3  # negative control: the weights did come from the checkpoint
    assert (tmp_path / "ck" / "step_00000002" / "manifest.json").is_file() and step.is_dir()
    assert metrics_steps(tmp_path / "run" / "run") == rows


def test_bf16_checkpoint_exports_in_bf16_and_fp32_that_compute_what_the_bf16_modules_compute(tmp_path):
    """A bf16 run's step directory holds the bf16 weights its engines computed with (the fp32 masters
    sit in the optimizer files, for resuming); those are the trained modules. ``--dtype bf16`` writes
    them as they are, ``--dtype fp32`` widens them exactly, and both compute what the modules do."""
    from safetensors.torch import load_file

    from disttrain_ds.checkpoint.export import export_checkpoint
    from disttrain_ds.checkpoint.read import read_module_state, step_recipe, verified_manifest
    from disttrain_ds.mllm.recipe_spec import meta_spec

    _, params, _ = launch(tmp_path / "run", 4, ["layout=disaggregated", "train.dtype=bf16", "train.steps=2",
                                                "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}"])
    step = tmp_path / "ck" / "step_00000002"
    assert {v.dtype for v in params.values() if v.is_floating_point()} == {torch.bfloat16}
    recipe = step_recipe(verified_manifest(step, "llm"))
    spec = meta_spec(recipe, params["llm/embed/embed_tokens.weight"].shape[0])
    for dtype, want in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out = export_checkpoint(step, tmp_path / dtype, dtype=dtype, log=lambda line: None)
        for m in MODULES:
            state = _module_state(params, m)
            got = read_module_state(step, m)
            assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state), m
            for f in (out / m).glob("*.safetensors"):
                assert {t.dtype for t in load_file(str(f)).values()} == {want}, (dtype, f)
            # Run in fp32 on both sides: the exported tensors are the bf16 weights, bit for bit.
            assert output_diff(spec, m, state, out / m) <= 1e-5, (dtype, m)
    # Negative control: the same check against the generator's untrained init fails.
    init = {f"{d.name}/{k}": v for d in spec.layers("generator") for k, v in d.build().state_dict().items()}
    assert output_diff(spec, "generator", init, tmp_path / "fp32" / "generator") > 1e-4

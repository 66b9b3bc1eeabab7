"""Model families as plug-ins: the registry, recipe selection, Qwen2 as a second LLM family."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.families import FAMILIES, family_names
from disttrain_ds.models.layers import Sequential
from disttrain_ds.parallel.tensor_parallel import ColumnParallelLinear, TPContext, shard_layer
from disttrain_ds.recipe.schema import layer_counts, load_recipe, tp_shape_problem

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
FAMILIES_DIR = Path(__file__).resolve().parents[2] / "disttrain_ds" / "families"


def test_every_role_has_its_default_family_and_qwen2_is_an_llm_family():
    assert family_names("encoder") == ["vit", "clip", "siglip", "whisper"] and family_names("generator") == ["unet", "dit"]
    assert family_names("llm") == ["llama", "qwen2"]


def test_family_records_import_no_network_code():
    # Recipe validation reads the records; torch, transformers and diffusers stay unloaded.
    code = "import sys, disttrain_ds.recipe.schema; print(sorted(m for m in ('torch', 'transformers', 'diffusers') if m in sys.modules))"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_each_family_lives_in_its_own_folder():
    for name, fam in FAMILIES.items():
        assert fam.model == f"disttrain_ds.families.{name}.model"
        assert (FAMILIES_DIR / name / "__init__.py").is_file() and (FAMILIES_DIR / name / "model.py").is_file()
        assert fam.tp_plan(), name


@pytest.mark.parametrize("override, needle", [
    ("model.llm.family=gpt2", "'model.llm.family' must be one of llama | qwen2 (the llm families), got 'gpt2'"),
    ("model.encoder.family=llama", "'model.encoder.family' must be one of vit | clip | siglip | whisper (the encoder families), got 'llama'"),
    ("model.encoder.family=whisper", "'model.encoder.family' whisper has its own settings: write the model as model.modules"),
])
def test_unknown_or_misplaced_family_is_a_one_line_error(override, needle):
    with pytest.raises(ConfigError) as e:
        load_recipe(TINY, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_presets_come_from_the_modules_family():
    r = load_recipe(TINY, ["model.llm.family=qwen2", "model.llm.preset=qwen2-7b"])
    assert (r.model.llm.hidden_size, r.model.llm.kv_heads, r.model.llm.vocab_size) == (3584, 4, 152064)
    with pytest.raises(ConfigError, match="'model.llm.preset' must be one of tiny | qwen2-7b, got 'llama-7b'"):
        load_recipe(TINY, ["model.llm.family=qwen2", "model.llm.preset=llama-7b"])


def test_shape_rules_and_layer_counts_come_from_the_family():
    r = load_recipe(TINY, ["model.llm.family=qwen2"])
    assert layer_counts(r)["llm"] == r.model.llm.layers + 2
    assert tp_shape_problem(r, "llm", 4) == ("model.llm.kv_heads", "2 does not split over the llm's tensor-parallel degree 4")


def _qwen2_spec(spec):
    return spec.with_changes("llm", family="qwen2")


def test_qwen2_layers_load_transformers_save_pretrained_and_match_its_logits(tmp_path, tiny_spec):
    from transformers import Qwen2ForCausalLM

    from disttrain_ds.families.qwen2.model import hf_config

    spec = _qwen2_spec(tiny_spec)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        hf = Qwen2ForCausalLM(hf_config(spec.llm))
        for layer in hf.model.layers:  # non-zero q/k/v biases, so a dropped bias shows
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path / "qwen2")
    loaded = spec.with_changes("llm", checkpoint=str(tmp_path / "qwen2"))
    ids = torch.randint(0, 200, (1, 12))
    ours, _ = Sequential([d.build() for d in loaded.layers("llm")])((ids, torch.zeros(0, spec.llm.hidden_size), torch.zeros_like(ids)))
    theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # Negative control: the same weights read by the Llama family (no q/k/v biases) differ.
    as_llama = loaded.with_changes("llm", family="llama")
    other, _ = Sequential([d.build() for d in as_llama.layers("llm")])((ids, torch.zeros(0, spec.llm.hidden_size), torch.zeros_like(ids)))
    assert (other - theirs).abs().max() > 1e-2


def test_qwen2_tensor_parallel_plan_shards_qkv_biases(tiny_spec):
    spec = _qwen2_spec(tiny_spec)
    block = spec.layers("llm")[1].build()
    full_bias = block.layer.self_attn.q_proj.bias.detach().clone()
    shard_layer(block, TPContext(None, 1, 2))
    q = block.layer.self_attn.q_proj
    assert isinstance(q, ColumnParallelLinear)
    half = full_bias.shape[0] // 2
    assert torch.equal(q.bias.detach(), full_bias[half:])

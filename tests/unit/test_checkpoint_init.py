"""Initialising modules from local save_pretrained weights (no download)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from disttrain_ds.mllm.model import MLLMSpec
from disttrain_ds.models.layers import Sequential
from disttrain_ds.samples import doc_ids


def test_llm_layers_load_transformers_save_pretrained(tmp_path, tiny_spec):
    from transformers import LlamaForCausalLM

    from disttrain_ds.families.llama.model import hf_config

    with torch.random.fork_rng():
        torch.manual_seed(99)
        hf = LlamaForCausalLM(hf_config(tiny_spec.llm))
    hf.save_pretrained(tmp_path / "llama")
    spec = tiny_spec.with_changes("llm", checkpoint=str(tmp_path / "llama"))
    ours = Sequential([d.build() for d in spec.layers("llm")])
    ids = torch.randint(0, 200, (1, 12))
    logits, _ = ours((ids, torch.zeros(0, spec.llm.hidden_size), torch.zeros_like(ids)))
    torch.testing.assert_close(logits, hf(ids).logits, rtol=1e-4, atol=1e-4)
    # Packed after another document, a document's logits are transformers' for it alone.
    packed = torch.cat([torch.randint(0, 200, (1, 7)), ids], dim=1)
    logits, _ = ours((packed, torch.zeros(0, spec.llm.hidden_size), doc_ids((7, 12), 19).unsqueeze(0)))
    torch.testing.assert_close(logits[:, 7:], hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_vit_and_unet_weights_load_and_differ_from_seeded_init(tmp_path, tiny_spec):
    from transformers import ViTModel

    from disttrain_ds.families.unet.model import build_unet
    from disttrain_ds.families.vit.model import hf_config

    with torch.random.fork_rng():
        torch.manual_seed(5)
        vit = ViTModel(hf_config(tiny_spec.config("encoder")), add_pooling_layer=False)
        unet = build_unet(tiny_spec.config("generator"))
    vit.save_pretrained(tmp_path / "vit")
    unet.save_pretrained(tmp_path / "unet")
    spec = tiny_spec.with_changes("encoder", checkpoint=str(tmp_path / "vit"))
    spec = spec.with_changes("generator", checkpoint=str(tmp_path / "unet"))
    block0 = spec.layers("encoder")[1].build()
    assert torch.equal(block0.layer.attention.q_proj.weight, vit.layers[0].attention.q_proj.weight)
    mid = next(d for d in spec.layers("generator") if d.name == "mid").build()
    loaded, theirs = mid.block.state_dict(), unet.mid_block.state_dict()
    assert loaded.keys() == theirs.keys() and all(torch.equal(loaded[k], theirs[k]) for k in theirs)
    seeded = next(d for d in tiny_spec.layers("generator") if d.name == "mid").build().block.state_dict()
    assert any(not torch.equal(loaded[k], seeded[k]) for k in seeded)


def test_shape_mismatch_names_the_layer(tmp_path, tiny_spec):
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(7)}, str(tmp_path / "bad.safetensors"))
    spec: MLLMSpec = tiny_spec.with_changes("llm", checkpoint=str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="llm head.norm.weight has shape"):
        spec.layers("llm")[-1].build()


def test_missing_checkpoint_is_a_recipe_error():
    from pathlib import Path

    from disttrain_ds.errors import ConfigError
    from disttrain_ds.recipe.schema import load_recipe

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="'model.llm.checkpoint'"):
        load_recipe(tiny, ["model.llm.checkpoint=/nonexistent/llama"])


def _saved_llama(tmp_path, name: str, **changes) -> str:
    from transformers import LlamaForCausalLM

    from disttrain_ds.estimate.memory import vocab_size
    from disttrain_ds.families.llama.model import hf_config

    recipe = load_recipe_tiny([])
    cfg = dataclasses.replace(recipe.model.llm, vocab_size=vocab_size(recipe), **changes)
    LlamaForCausalLM(hf_config(cfg)).save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def load_recipe_tiny(overrides):
    from pathlib import Path

    from disttrain_ds.recipe.schema import load_recipe

    return load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml", overrides)


def test_a_checkpoint_covering_the_module_passes_the_import_check(tmp_path):
    from disttrain_ds.runtime.imports import check_imports

    check_imports(load_recipe_tiny([f"model.llm.checkpoint={_saved_llama(tmp_path, 'llama')}"]))


@pytest.mark.parametrize("case, needle", [
    ("vit", "this family reads llama checkpoints"),  # its config.json says what it is
    ("vit_weights", "holds none of the llm's"),  # the same weights without their config.json
    ("fewer_layers", "lacks 18 of the llm's"),
    ("wider", "has shape"),
])
def test_a_checkpoint_that_would_leave_weights_random_is_refused_in_one_line(tmp_path, case, needle):
    """Weights that do not cover the module are refused; the shape cases are weights directories
    without a config.json (with one, the module takes the checkpoint's shapes)."""
    from transformers import ViTModel

    from disttrain_ds.errors import ConfigError
    from disttrain_ds.families.vit.model import hf_config
    from disttrain_ds.runtime.imports import check_imports

    if case.startswith("vit"):
        recipe = load_recipe_tiny([])
        ViTModel(hf_config(recipe.model.encoder), add_pooling_layer=False).save_pretrained(tmp_path / "vit")
        path = str(tmp_path / "vit")
    else:
        path = _saved_llama(tmp_path, case, **({"layers": 2} if case == "fewer_layers" else {"ffn_hidden": 256}))
    if case != "vit":
        (Path(path) / "config.json").unlink()
    with pytest.raises(ConfigError) as e:
        check_imports(load_recipe_tiny([f"model.llm.checkpoint={path}"]))
    msg = str(e.value)
    assert "'model.llm.checkpoint'" in msg and needle in msg and "\n" not in msg

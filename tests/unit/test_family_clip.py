"""The CLIP and SigLIP vision-tower families: a tower saved by transformers imports with its
config.json, and its patch features equal the library's ``hidden_states[feature_layer]`` (CLS
dropped, as LLaVA takes them) at any image size; export writes a tower transformers reads back to
the same features and that imports back bit for bit; settings the family cannot build are refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from disttrain_ds.checkpoint.export import export_module
from disttrain_ds.errors import ConfigError
from disttrain_ds.families import FAMILIES
from disttrain_ds.models.layers import Sequential
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.imports import check_imports
from disttrain_ds.runtime.setup import build_data_and_spec

SIZES = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=3, image_size=32,
             patch_size=8)
"""Not the tiny preset's: 3 heads, 4 layers, another width."""
KINDS = {
    "clip": ("CLIPVisionConfig", "CLIPVisionModel", dict(layer_norm_eps=1e-4, hidden_act="gelu")),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", dict(layer_norm_eps=1e-5)),
}


def _tower(tmp_path, family: str, **extra):
    config, model, settings = KINDS[family]
    cfg = getattr(transformers, config)(**SIZES, **settings, **extra)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        hf = getattr(transformers, model)(cfg).eval()
    hf.save_pretrained(tmp_path / family)
    return tmp_path / family, hf


def _recipe(family: str, path, *more):
    return load_recipe("tiny_vlm", [f"model.modules.vision.family={family}", f"model.modules.vision.checkpoint={path}",
                                    *more])


def _features(spec, images: list[torch.Tensor]) -> torch.Tensor:
    tower = Sequential([d.build() for d in spec.layers("vision")[:-1]]).eval()  # the projector aside
    flat = torch.cat([im.reshape(-1) for im in images])
    hw = torch.tensor([list(im.shape[1:]) for im in images])
    with torch.no_grad():
        return tower((flat, hw))


def _theirs(hf, images: list[torch.Tensor], layer: int, cls: bool) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for im in images:
            out = hf(pixel_values=im.unsqueeze(0), output_hidden_states=True, interpolate_pos_encoding=True)
            rows.append(out.hidden_states[layer][0, 1 if cls else 0:])
    return torch.cat(rows)


IMAGES = [torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(1)),
          torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(2))]  # the grid, and interpolated


@pytest.mark.parametrize("family", sorted(KINDS))
@pytest.mark.parametrize("layer", [-2, -1, 2])
def test_tower_features_equal_transformers_hidden_states(tmp_path, family, layer):
    path, hf = _tower(tmp_path, family)
    recipe = _recipe(family, path, f"model.modules.vision.feature_layer={layer}")
    vision = recipe.model.modules["vision"]
    assert (vision.hidden_size, vision.layers, vision.heads, vision.ffn_hidden) == (48, 4, 3, 80)
    assert vision.layer_norm_eps == KINDS[family][2]["layer_norm_eps"]
    check_imports(recipe)
    spec = build_data_and_spec(recipe)[1]
    ours = _features(spec, IMAGES)
    assert ours.shape == (16 + 6, 48)  # patches only: one row per LLM placeholder
    cls = family == "clip"
    torch.testing.assert_close(ours, _theirs(hf, IMAGES, layer, cls), rtol=1e-5, atol=1e-5)
    # Negative control: another layer's hidden states are not these features.
    assert (ours - _theirs(hf, IMAGES, layer - 1 if layer != 2 else 3, cls)).abs().max() > 1e-3


def test_a_whole_clip_model_checkpoint_gives_its_vision_tower(tmp_path):
    vision = transformers.CLIPVisionConfig(**SIZES)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        whole = transformers.CLIPModel(transformers.CLIPConfig(vision_config=vision.to_dict(), text_config=text))
    whole.save_pretrained(tmp_path / "clip")
    recipe = _recipe("clip", tmp_path / "clip")
    assert recipe.model.modules["vision"].layers == 4
    check_imports(recipe)
    ours = _features(build_data_and_spec(recipe)[1], IMAGES)
    torch.testing.assert_close(ours, _theirs(whole.vision_model.eval(), IMAGES, -2, True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(KINDS))
def test_export_writes_the_layers_run_and_reads_back_the_same(tmp_path, family):
    path, hf = _tower(tmp_path, family)
    recipe = _recipe(family, path)  # feature layer -2: 3 of 4 layers run
    spec = build_data_and_spec(recipe)[1]
    layers = [d.build() for d in spec.layers("vision")]
    state = {f"{d.name}/{k}": v for d, layer in zip(spec.layers("vision"), layers) for k, v in layer.state_dict().items()}
    export_module(recipe, "vision", state, tmp_path / "out", torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["feature_layer"]) == (3, -1)
    back = getattr(transformers, KINDS[family][1]).from_pretrained(tmp_path / "out").eval()
    ours = _features(spec, IMAGES)
    torch.testing.assert_close(_theirs(back, IMAGES, -1, family == "clip"), ours, rtol=1e-5, atol=1e-5)
    again = _recipe(family, tmp_path / "out")
    assert (again.model.modules["vision"].layers, again.model.modules["vision"].feature_layer) == (3, -1)
    rebuilt = build_data_and_spec(again)[1]
    for d, layer in zip(rebuilt.layers("vision"), layers):
        for (k, v), (k2, v2) in zip(d.build().state_dict().items(), layer.state_dict().items()):
            assert k == k2 and torch.equal(v, v2), (d.name, k)


@pytest.mark.parametrize("family, change, key", [
    ("clip", {"num_channels": 1}, "num_channels"),
    ("clip", {"hidden_act": "relu"}, "hidden_act"),
    ("siglip", {"attention_dropout": 0.1}, "attention_dropout"),
])
def test_settings_a_tower_cannot_build_are_refused_in_one_line(tmp_path, family, change, key):
    path, _ = _tower(tmp_path, family)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as err:
        _recipe(family, path)
    assert f"'{key}'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("layer", [0, 5, -5])
def test_a_feature_layer_outside_the_tower_is_one_line(layer):
    with pytest.raises(ConfigError, match="'model.modules.vision.feature_layer' .* names no layer of a 3-layer tower"):
        load_recipe("tiny_vlm", ["model.modules.vision.family=clip", f"model.modules.vision.feature_layer={layer}"])


def test_mfu_prices_the_layers_run_not_the_whole_tower():
    fam = FAMILIES["clip"]
    cfg = load_recipe("tiny_vlm", ["model.modules.vision.family=clip", "model.modules.vision.layers=5"]).model.modules["vision"]
    assert fam.run_layers(cfg) == 4 and fam.layer_count(cfg) == 6
    assert FAMILIES["vit"].run_layers(load_recipe("tiny_vlm").model.modules["vision"]) == 2


def test_mfu_counts_a_cls_token_for_clip_and_none_for_siglip():
    from disttrain_ds.metrics.step_flops import StepFlopsCounter

    flops = {}
    for family in ("clip", "siglip"):
        recipe = load_recipe("tiny_vlm", [f"model.modules.vision.family={family}"])
        source, spec = build_data_and_spec(recipe)
        flops[family] = StepFlopsCounter(spec)(source.global_batch(0)).modules["vision"]
    assert flops["clip"] > flops["siglip"] > 0  # same sizes and images: only the CLS rows differ

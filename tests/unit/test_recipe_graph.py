"""Recipes as module graphs: parsing, the three-module form mapped onto the graph, one-line errors."""

from __future__ import annotations

import pytest
import yaml

from disttrain_ds.errors import ConfigError
from disttrain_ds.families.whisper import AudioEncoderConfig
from disttrain_ds.recipe.graph import graph_of, module_config, module_parallel, topology_of
from disttrain_ds.recipe.schema import load_recipe


def test_three_module_recipes_become_a_graph_of_their_roles():
    r = load_recipe("tiny_cpu", ["layout=disaggregated"])
    assert graph_of(r).names == ("encoder", "llm", "generator")
    assert module_config(r, "encoder") is r.model.encoder and module_parallel(r, "llm") is r.parallel.llm
    assert [g.name for g in topology_of(r).modules] == ["encoder", "llm", "generator"]


def test_graph_recipe_names_its_modules_and_maps_single_roles_back():
    r = load_recipe("tiny_vlm", ["layout=disaggregated", "parallel.modules.vision.dp=2", "train.micro_batch=2"])
    g = graph_of(r)
    assert g.names == ("vision", "llm") and g.generators == ()
    assert r.model.encoder is module_config(r, "vision") and r.model.generator is None
    assert module_parallel(r, "vision").dp == 2 and r.parallel.generator is None
    assert topology_of(r).world_size == 2 + 2


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _graph(**modules) -> dict:
    return {"name": "g", "model": {"modules": modules},
            "data": {"max_images": 0, "image_sizes": [16]}, "deepspeed_config": "ds_configs/cpu_fp32.json"}


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["model"].update(encoder={"preset": "tiny"}), "'model.encoder' cannot be used with 'model.modules'"),
    (lambda d: d.update(parallel={"modules": {"vison": {"dp": 1}}}), "'parallel.modules.vison' names no module"),
    (lambda d: d["model"]["modules"]["llm"].pop("family"), "'model.modules.llm.family' must be one of"),
    (lambda d: d["model"]["modules"]["llm"].update(heads=3), "'model.modules.llm.heads' 3 must divide hidden_size"),
    (lambda d: d["model"]["modules"].update(ear={"family": "whisper"}),
     "'data.max_audio' must be >= 1: model.modules.ear reads up to max_audio clips per sequence"),
    (lambda d: (d["model"]["modules"].update(ear={"family": "whisper"}), d["data"].update(max_audio=1, source="laion")),
     "'data.source' model.modules.ear reads audio clips, which data.source synthetic, local, webdataset, parquet, "
     "folder, hf produce; got laion"),
    (lambda d: (d["model"]["modules"].update(ear={"family": "whisper", "max_frames": 32}), d["data"].update(max_audio=1)),
     "'data.audio_frames' clips of up to 64 frames exceed model.modules.ear.max_frames 32"),
    (lambda d: d["data"].update(max_audio=1), "'data.max_audio' must be 0: the model has no audio encoder"),
    (lambda d: (d["model"]["modules"].update(eye={"family": "vit"}, eye2={"family": "vit"}), d["data"].update(max_images=1)),
     "one encoder per modality so far (each fills its own placeholder token); got encoders ['eye', 'eye2']"),
    (lambda d: (d["model"]["modules"].pop("painter"), d["model"]["modules"].update(eye={"family": "vit"}),
                d["data"].update(max_images=1)), "'data.gen_prob' must be 0: the model has no generator"),
    (lambda d: (d["model"]["modules"].update(other={"family": "dit"}), d["data"].update(source="paper_stats")),
     "'data.source' paper_stats gives generation targets to one generator only; the generators other, painter need"),
    (lambda d: d["data"].update(max_images=2), "'data.max_images' must be 0: the model has no image encoder"),
])
def test_bad_graph_recipes_are_one_line_errors(tmp_path, change, needle):
    data = _graph(llm={"family": "llama"}, painter={"family": "unet"})
    change(data)
    with pytest.raises(ConfigError) as e:
        load_recipe(_write(tmp_path, data))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_family_with_its_own_settings_parses_them(tmp_path):
    from disttrain_ds.recipe.graph import expand_graph_sections

    data = expand_graph_sections({"model": {"modules": {"llm": {"family": "llama"}, "ear": {
        "family": "whisper", "preset": "whisper-small", "layers": 3}}}}, "r.yaml")
    ear = data["model"]["modules"]["ear"]
    assert isinstance(ear, AudioEncoderConfig) and (ear.n_mels, ear.hidden_size, ear.layers) == (80, 768, 3)
    with pytest.raises(ConfigError, match="unknown key 'model.modules.ear.patch_size'"):
        expand_graph_sections({"model": {"modules": {"llm": {"family": "llama"}, "ear": {
            "family": "whisper", "patch_size": 8}}}}, "r.yaml")


def test_graph_recipe_with_a_dit_generator_loads_and_validates(tmp_path):
    from disttrain_ds.families.dit import DiTConfig, forward_flops
    from disttrain_ds.runtime.setup import cost_model
    from disttrain_ds.samples import SampleStats

    data = _graph(llm={"family": "llama"}, art={"family": "dit", "layers": 3})
    data["parallel"] = {"modules": {"art": {"pp": 2}}}
    r = load_recipe(_write(tmp_path, data), ["layout=disaggregated"])
    art = module_config(r, "art")
    assert isinstance(art, DiTConfig) and r.model.generator is art and art.layers == 3
    assert graph_of(r).generators == ("art",) and module_parallel(r, "art").pp == 2
    assert [g.name for g in topology_of(r).modules] == ["llm", "art"]
    # Balancing costs one generated image at the DiT's forward FLOPs.
    one = SampleStats(text_tokens=128, image_patches=(), seq_len=128, gens=((1, art.resolution),))
    assert cost_model(r).module_cost("art", one) == pytest.approx(forward_flops(art))
    # The MFU meter counts each generated image at 3 x forward (trained) plus the projector's share.
    from disttrain_ds.cost.flops import projector_flops_per_token
    from disttrain_ds.metrics.step_flops import StepFlopsCounter
    from disttrain_ds.runtime.setup import build_data_and_spec

    source, spec = build_data_and_spec(r)
    samples = source.global_batch(0)
    source.close()
    images = sum(int(s.gen_targets[0].shape[0]) for s in samples)
    proj = projector_flops_per_token(in_dim=r.model.llm.hidden_size, hidden_dim=32, out_dim=32)
    assert images > 0 and StepFlopsCounter(spec)(samples).modules["art"] == pytest.approx(
        images * (3 * forward_flops(art) + art.query_tokens * proj))
    with pytest.raises(ConfigError, match="'model.modules.art.heads' must be >= 1"):
        load_recipe(_write(tmp_path, {**data, "model": {"modules": {"llm": {"family": "llama"},
                                                                    "art": {"family": "dit", "heads": 0}}}}))

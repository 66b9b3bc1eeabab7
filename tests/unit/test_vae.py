"""The frozen VAE: presets, local checkpoints, latents (posterior mean x scaling factor), both
placements drawing the same noise, recipe checks, FLOPs apart from MFU, memory on the generator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.vae import LatentEncoder, build_vae, encode, vae_kwargs
from disttrain_ds.models.vae_config import VaeConfig
from disttrain_ds.recipe.schema import load_recipe

TINY = VaeConfig(preset="tiny")


def test_sd21_preset_is_stable_diffusion_2_1s_vae_shape():
    r = VaeConfig(preset="sd21").resolved()
    assert r.block_out_channels == [128, 256, 512, 512] and r.latent_channels == 4
    assert r.scaling_factor == 0.18215 and VaeConfig(preset="sd21").downsample == 8
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        full = AutoencoderKL(**vae_kwargs(VaeConfig(preset="sd21")))
    assert 83.0e6 < sum(p.numel() for p in full.parameters()) < 84.0e6  # SD 2.1's VAE: 83.65M


def _saved_vae(path, cfg=TINY, seed=3):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(**vae_kwargs(cfg)).eval()
    vae.save_pretrained(path)
    return vae


def test_a_checkpoint_gives_diffusers_posterior_mean_times_the_scaling_factor(tmp_path):
    full = _saved_vae(tmp_path / "vae")
    images = torch.rand(3, 3, 16, 16) * 2 - 1
    ours = LatentEncoder(VaeConfig(checkpoint=str(tmp_path / "vae")), seed=0)(images)
    with torch.no_grad():
        theirs = torch.cat([full.encode(im[None]).latent_dist.mean for im in images]) * full.config.scaling_factor
    assert ours.shape == (3, 4, 8, 8)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    seeded = LatentEncoder(TINY, seed=0)(images)  # negative control: other weights, other latents
    assert (seeded - ours).abs().max() > 1e-3


def test_latents_do_not_depend_on_what_an_image_is_batched_with():
    vae, images = build_vae(TINY, seed=1), torch.rand(4, 3, 16, 16) * 2 - 1
    assert torch.equal(encode(vae, images)[2], encode(vae, images[2:3])[0])


def test_the_seeded_vae_is_the_same_in_every_process_and_frozen():
    a, b = build_vae(TINY, seed=5), build_vae(TINY, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not any(p.requires_grad for p in a.parameters()) and not a.training


@pytest.mark.parametrize("breakage", ["missing", "no_config", "not_a_vae", "bad_weights"])
def test_bad_vae_checkpoints_are_refused_in_one_line_naming_the_path(tmp_path, breakage):
    path = tmp_path / "vae"
    if breakage != "missing":
        _saved_vae(path)
    if breakage == "no_config":
        (path / "config.json").unlink()
    elif breakage == "not_a_vae":
        (path / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    elif breakage == "bad_weights":
        (path / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError) as err:
        build_vae(VaeConfig(checkpoint=str(path)), seed=0, key="model.generator.vae")
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "model.generator.vae.checkpoint" in msg


def _latent_recipe(*overrides):
    return load_recipe("tiny_cpu_latent", list(overrides))


def test_producer_placement_makes_latent_batches_from_rgb_images():
    from disttrain_ds.data.registry import open_source, resolve
    from disttrain_ds.runtime.setup import shape_spec

    r = _latent_recipe()
    shape = shape_spec(r)
    assert (shape.gens[0].channels, shape.gens[0].resolution, shape.vae.preset) == (3, 16, "tiny")
    src = open_source(resolve(r.data), shape, 4, r.seed)
    pixels = open_source(resolve(r.data), dataclasses.replace(shape, vae=None), 4, r.seed).global_batch(0)
    latents = src.global_batch(0)
    enc = LatentEncoder(r.model.generator.vae, r.seed)
    for p, s in zip(pixels, latents):
        assert s.gen_targets[0].shape[1:] == (4, 8, 8)
        assert torch.equal(s.gen_targets[0], enc(p.gen_targets[0]))
        assert s.stats(8, src.special).gen(0)[1] == 8  # the cost model sees latent sides
    assert "latents" in src.describe()


def test_generator_placement_noises_the_same_latents_and_the_loss_stage_draws_the_same_noise():
    from disttrain_ds.data.registry import open_source, resolve
    from disttrain_ds.mllm.model import BatchNorms, collate
    from disttrain_ds.models.vae import generator_vae
    from disttrain_ds.runtime.setup import build_data_and_spec, shape_spec

    prod = _latent_recipe("model.generator.vae.placement=producer")
    gen = _latent_recipe("model.generator.vae.placement=generator")
    assert shape_spec(gen).vae is None and shape_spec(gen).gens[0].resolution == 16
    s_prod = open_source(resolve(prod.data), shape_spec(prod), 4, prod.seed).global_batch(0)
    s_gen = open_source(resolve(gen.data), shape_spec(gen), 4, gen.seed).global_batch(0)
    assert s_gen[0].gen_targets[0].shape[1] == 3  # pixels travel
    _, spec_p = build_data_and_spec(prod)
    _, spec_g = build_data_and_spec(gen)
    norms = BatchNorms.of(s_prod, 4)
    a = collate(s_prod, norms, spec_p)
    b = collate(s_gen, norms, spec_g, vae=generator_vae(spec_g))
    c = collate(s_gen, norms, spec_g)  # a generator stage without the VAE (the loss stage)
    a, b, c = (x.gens["generator"] for x in (a, b, c))
    assert torch.equal(a.noisy, b.noisy) and a.noisy.shape[1:] == (4, 8, 8)
    for g in (b, c):
        assert torch.equal(a.noise, g.noise) and torch.equal(a.timesteps, g.timesteps)
        assert torch.equal(a.weights, g.weights)
    assert c.noisy.numel() == 0


def test_another_vae_gives_other_latents():
    """Negative control for the fidelity tests: a VAE scaled otherwise is visible in the targets."""
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    a = LatentEncoder(TINY, 0)(images)
    b = LatentEncoder(dataclasses.replace(TINY, scaling_factor=0.7), 0)(images)
    torch.testing.assert_close(b, a * 0.7 / 0.5)
    assert not torch.allclose(a, b)


def test_paper_recipes_accept_real_images_with_their_vae_and_refuse_them_without(tmp_path):
    path = tmp_path / "captions.jsonl"
    path.write_text('{"caption": "a cat", "url": "http://x/cat.jpg"}\n')
    real = ["data.source=laion", f"data.path={path}"]
    for name in ("mllm_9b", "mllm_15b", "mllm_72b"):
        r = load_recipe(name, real)
        assert r.model.generator.vae.preset == "sd21" and r.model.generator.vae.placement == "generator"
    with pytest.raises(ConfigError, match=r"'model.generator.in_channels'.*vae.preset"):
        load_recipe("mllm_9b", [*real, "model.generator.vae.preset="])


@pytest.mark.parametrize("override, key", [
    ("model.generator.vae.preset=sd3", "model.generator.vae.preset"),
    ("model.generator.vae.placement=host", "model.generator.vae.placement"),
    ("model.generator.vae.latent_channels=8", "model.generator.vae.latent_channels"),
    ("model.generator.vae.checkpoint=/no/such/vae", "model.generator.vae.checkpoint"),
])
def test_bad_vae_sections_are_refused_naming_the_field(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _latent_recipe(override)


def test_cost_model_sees_latent_sides_in_both_placements():
    from disttrain_ds.runtime.setup import cost_model

    assert cost_model(_latent_recipe("model.generator.vae.placement=producer")).own["generator"].gen_downsample == 1  # latents travel
    assert cost_model(_latent_recipe("model.generator.vae.placement=generator")).own["generator"].gen_downsample == 2  # pixels travel


def test_vae_flops_are_reported_apart_from_mfu():
    from disttrain_ds.cost.flop_count import vae_encode_flops
    from disttrain_ds.metrics.step_flops import MfuMeter
    from disttrain_ds.runtime.setup import build_data_and_spec

    assert 1.0e12 < vae_encode_flops(VaeConfig(preset="sd21"), 512) < 1.2e12  # ~1.1 TFLOP per 512 px image
    out = {}
    for placement in ("producer", "generator"):
        src, spec = build_data_and_spec(_latent_recipe(f"model.generator.vae.placement={placement}"))
        samples = src.global_batch(0)
        meter = MfuMeter(spec, {"encoder": 1, "llm": 2, "generator": 1}, 4, 1.0, None)
        out[placement] = meter(samples, 1.0)
        n_gen = sum(s.gen_targets[0].shape[0] for s in samples)
        assert out[placement]["perf/vae_tflop"] == pytest.approx(n_gen * vae_encode_flops(spec.config("generator").vae, 16) / 1e12)
        no_vae = MfuMeter(spec.with_changes("generator", vae=VaeConfig()),
                          {"encoder": 1, "llm": 2, "generator": 1}, 4, 1.0, None)(samples, 1.0)
        assert "perf/vae_tflop" not in no_vae
        assert out[placement]["perf/mfu/overall"] == no_vae["perf/mfu/overall"]  # not in MFU's numerator
    assert "perf/tflops_per_gpu/vae" in out["generator"] and "perf/tflops_per_gpu/vae" not in out["producer"]


def test_memory_dry_run_counts_the_vae_on_the_generators_first_stage_only():
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.estimate.memory_check import describe

    pp2 = load_recipe("mllm_9b", ["parallel.generator.pp=2"])
    on_gen = estimate(pp2)
    rows = {(r.module, r.stage): r for r in on_gen}
    assert rows[("generator", 0)].extra > 34e6 * 2 + 8 * 3 * 2 * 128 * 512**2  # bf16 encoder weights, 8 images' activations
    assert rows[("generator", 1)].extra == 0 and all(r.extra == 0 for r in on_gen if r.module != "generator")
    producer = estimate(load_recipe("mllm_9b", ["parallel.generator.pp=2", "model.generator.vae.placement=producer"]))
    assert all(r.extra == 0 for r in producer)
    assert any("frozen VAE" in line for line in describe(pp2, on_gen, 80, "test"))

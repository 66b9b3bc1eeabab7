"""Model construction: published parameter counts, shapes, and split-equals-unsplit."""

from __future__ import annotations

import pytest
import torch

from disttrain_ds.families.llama.config import LLM_PRESETS, LLMConfig
from disttrain_ds.families.unet.config import GENERATOR_PRESETS, GeneratorConfig
from disttrain_ds.families.unet.model import build_unet
from disttrain_ds.families.vit.config import ENCODER_PRESETS, EncoderConfig
from disttrain_ds.families.vit.model import hf_config as vit_hf_config
from disttrain_ds.mllm.model import MLLMSpec
from disttrain_ds.models.layers import Sequential
from disttrain_ds.samples import SpecialTokens


def _meta_params(module: str, llm: str = "llama-7b") -> int:
    with torch.device("meta"):
        spec = MLLMSpec(
            {"encoder": EncoderConfig(**ENCODER_PRESETS["vit-h-14"]), "llm": LLMConfig(**LLM_PRESETS[llm]),
             "generator": GeneratorConfig(**GENERATOR_PRESETS["sd21"])},
            {"encoder": "encoder", "llm": "llm", "generator": "generator"},
            SpecialTokens.after(32000),
            seed=0,
        )
        return sum(p.numel() for d in spec.layers(module) for p in d.build().parameters())


@pytest.mark.parametrize(
    "preset, published",
    [
        ("llama-7b", 6.74e9),  # Llama-2-7B model card
        ("llama-13b", 13.0e9),  # Llama-2-13B model card
        ("llama-70b", 70.6e9),  # Llama-3-70B model card
    ],
)
def test_llm_preset_parameter_count_matches_published(preset, published):
    assert _meta_params("llm", preset) == pytest.approx(published, rel=0.01)


def test_vit_huge_parameter_count_matches_published():
    from transformers import ViTModel

    with torch.device("meta"):
        vit = ViTModel(vit_hf_config(EncoderConfig(**ENCODER_PRESETS["vit-h-14"])), add_pooling_layer=True)
    # google/vit-huge-patch14-224-in21k: 632M parameters (paper: ViT-Huge, 0.63B).
    assert sum(p.numel() for p in vit.parameters()) == pytest.approx(632e6, rel=0.005)


def test_sd21_unet_parameter_count_matches_published():
    with torch.device("meta"):
        unet = build_unet(GeneratorConfig(**GENERATOR_PRESETS["sd21"]))
    # stabilityai/stable-diffusion-2-1 U-Net: 865,910,724 parameters.
    assert sum(p.numel() for p in unet.parameters()) == 865_910_724


def test_mllm_totals_match_paper_names():
    enc, gen = _meta_params("encoder"), _meta_params("generator")
    for llm, total in (("llama-7b", 9e9), ("llama-13b", 15e9), ("llama-70b", 72e9)):
        assert enc + _meta_params("llm", llm) + gen == pytest.approx(total, rel=0.12)


def test_encoder_tokens_follow_image_resolution(tiny_spec):
    from disttrain_ds.models.pixels import pack_images

    enc = Sequential([d.build() for d in tiny_spec.layers("encoder")])
    p = tiny_spec.config("encoder").patch_size
    images = [torch.randn(3, 16, 16), torch.randn(3, 32, 24), torch.randn(3, 8, 8)]
    out = enc(pack_images(images))
    assert out.shape == (sum((h // p) * (w // p) for _, h, w in (im.shape for im in images)), tiny_spec.llm.hidden_size)


def test_encoder_packed_equals_one_image_at_a_time(tiny_spec):
    from disttrain_ds.models.pixels import pack_images

    enc = Sequential([d.build() for d in tiny_spec.layers("encoder")])
    images = [torch.randn(3, 16, 16), torch.randn(3, 32, 24), torch.randn(3, 16, 16)]
    together = enc(pack_images(images))
    alone = torch.cat([enc(pack_images([im])) for im in images])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_split_unet_equals_diffusers_forward(tiny_spec):
    from disttrain_ds.families.unet.model import _unet
    from disttrain_ds.models.layers import layer_seed

    gen = Sequential([d.build() for d in tiny_spec.layers("generator")])
    unet = _unet(tiny_spec.config("generator"), layer_seed(tiny_spec.seed, "generator", "init"))
    r, k = tiny_spec.config("generator").resolution, tiny_spec.config("generator").query_tokens
    states = torch.randn(2, k, tiny_spec.llm.hidden_size)
    noisy = torch.randn(2, 3, r, r)
    t = torch.tensor([3, 700])
    ours = gen((states, noisy, t))
    cond = gen.layers[0].proj(states)
    theirs = unet(noisy, t, encoder_hidden_states=cond).sample
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_layers_build_identical_weights_each_time(tiny_spec):
    for module in ("encoder", "llm", "generator"):
        for d in tiny_spec.layers(module):
            a, b = d.build().state_dict(), d.build().state_dict()
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a), f"{module}/{d.name} is not deterministic"


def test_reference_forward_backward_shapes_and_grads(tiny_spec, tiny_samples):
    from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate

    model = ReferenceMLLM(tiny_spec)
    mb = collate(tiny_samples, BatchNorms.of(tiny_samples, 1), tiny_spec)
    out = model(mb)
    assert out["loss"].shape == () and torch.isfinite(out["loss"])
    out["loss"].backward()
    for name in ("encoder", "llm", "generator"):
        grads = [p.grad for p in getattr(model, name).parameters()]
        assert all(g is not None for g in grads), f"{name} has parameters without gradient"
        assert any(g.abs().sum() > 0 for g in grads)

"""Cost model: FLOP-derived coefficients, scaling laws of each module, fitting, units."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain_ds.cost.dims import TransformerDims
from disttrain_ds.cost.model import (
    LLAMA_PRESETS,
    SD21_UNET,
    VIT_HUGE_14,
    CostModel,
    UNetDims,
    flops_to_ms,
)
from disttrain_ds.samples import SampleStats


def _sample(patches=(256,), gen=1, res=512, seq=8192, docs=()) -> SampleStats:
    return SampleStats(text_tokens=100, image_patches=tuple(patches), seq_len=seq, doc_lens=tuple(docs),
                       gens=((gen, res),))


def test_vit_huge_forward_flops_match_published_gmacs():
    # timm lists ViT-H/14 at 224x224 (16x16 patches + CLS) as 167.4 GMACs = 334.8 GFLOPs.
    cm = CostModel.paper_mllm("llama3-7b")
    assert cm.encoder_cost(_sample(patches=(256,))) == pytest.approx(334.8e9, rel=0.01)


def test_llm_cost_matches_dense_formula_for_one_document():
    d = LLAMA_PRESETS["llama3-7b"]
    cm = CostModel.from_dims(VIT_HUGE_14, d, SD21_UNET, vocab_size=32000)
    L = 4096
    head = d.hidden // d.heads
    per_token = d.layers * (2 * 4 * d.hidden * d.heads * head + 2 * 3 * d.hidden * d.ffn_hidden)
    attn = d.layers * 4 * d.hidden * L * (L + 1) / 2  # causal pairs, QK^T + AV
    expected = L * (per_token + 2 * d.hidden * 32000) + attn
    assert cm.llm_cost(_sample(seq=L, docs=(L,))) == pytest.approx(expected, rel=1e-12)


def test_llm_attention_is_cheaper_for_many_short_documents():
    cm = CostModel.paper_mllm()
    one = cm.llm_cost(_sample(seq=8192, docs=(8192,)))
    many = cm.llm_cost(_sample(seq=8192, docs=(1024,) * 8))
    unknown = cm.llm_cost(_sample(seq=8192, docs=()))
    assert many < one and unknown == pytest.approx(one)
    # the gap is exactly the attention term on sum of squared lengths
    assert one - many == pytest.approx(cm.llm_per_doc_token_sq * (8192**2 - 8 * 1024**2))


def test_encoder_cost_is_superlinear_in_patches_and_additive_over_images():
    cm = CostModel.paper_mllm()
    small, big = cm.encoder_cost(_sample(patches=(256,))), cm.encoder_cost(_sample(patches=(4096,)))
    assert big > 16 * small  # attention term makes 16x patches cost more than 16x
    two = cm.encoder_cost(_sample(patches=(256, 4096)))
    assert two == pytest.approx(small + big)
    assert cm.encoder_cost(_sample(patches=())) == 0.0


def test_generator_cost_scales_with_resolution_and_count():
    cm = CostModel.paper_mllm()
    r512, r1024 = cm.generator_cost(_sample(res=512)), cm.generator_cost(_sample(res=1024))
    assert r1024 > 4 * r512  # 4x latent pixels plus quadratic attention
    assert cm.generator_cost(_sample(gen=3, res=512)) == pytest.approx(3 * r512)
    assert cm.generator_cost(_sample(gen=0)) == 0.0
    # SD 2.1 U-Net at 512x512 is a few hundred GFLOPs per denoising step
    assert 3e11 < r512 < 1.5e12


def test_unet_attention_term_only_from_attention_levels():
    no_attn = UNetDims(channels=(320, 640), attention=(False, False))
    lin, pairs = no_attn.per_latent_flops()
    assert pairs == 0.0 and lin > 0
    assert UNetDims((320, 640), (True, False)).per_latent_flops()[1] > 0


def test_in_ms_converts_with_throughput():
    cm = CostModel.paper_mllm()
    s = _sample()
    ms = cm.in_ms(100e12)
    assert ms.llm_cost(s) == pytest.approx(cm.llm_cost(s) / 100e12 * 1e3)
    assert ms.encoder_cost(s) == pytest.approx(flops_to_ms(cm.encoder_cost(s), 200e12, mfu=0.5))
    with pytest.raises(ValueError, match="flops_per_s"):
        cm.in_ms(0)


def test_fit_recovers_known_coefficients():
    truth = CostModel(enc_per_patch=0.01, enc_per_patch_sq=2e-6, enc_per_image=0.5,
                      llm_per_token=0.02, llm_per_doc_token_sq=1e-7, gen_per_latent=0.003,
                      gen_per_latent_sq=4e-8, gen_per_image=1.0)
    rng = np.random.default_rng(0)
    samples = [_sample(patches=tuple(rng.integers(16, 4096, rng.integers(1, 6))),
                       gen=int(rng.integers(1, 4)), res=int(rng.choice([256, 512, 1024])),
                       docs=tuple(rng.integers(100, 2000, 4))) for _ in range(40)]
    start = CostModel(*(1.0,) * 6)
    fitted = start
    for module in ("encoder", "llm", "generator"):
        measured = [truth.module_cost(module, s) for s in samples]
        fitted = fitted.fit(module, samples, measured)
    for s in samples:
        assert fitted.train_cost(s) == pytest.approx(truth.train_cost(s), rel=1e-6)
    assert fitted.enc_per_patch_sq == pytest.approx(2e-6, rel=1e-4)


def test_fit_without_intercept_pins_constant_to_zero():
    samples = [_sample(patches=(n,)) for n in (100, 400, 900, 1600)]
    cm = CostModel(*(1.0,) * 6, enc_per_image=5.0)
    fitted = cm.fit("encoder", samples, [2.0 * n for n in (100, 400, 900, 1600)], intercept=False)
    assert fitted.enc_per_image == 0.0
    assert fitted.enc_per_patch == pytest.approx(2.0)
    with pytest.raises(ValueError, match="measured"):
        cm.fit("encoder", samples, [1.0])
    with pytest.raises(ValueError, match="module"):
        cm.fit("decoder", samples, [1.0] * 4)


def test_gqa_reduces_kv_projection_flops():
    mha = TransformerDims(80, 8192, 28672, 64, 64, gated_mlp=True)
    gqa = TransformerDims(80, 8192, 28672, 64, 8, gated_mlp=True)
    assert gqa.linear_flops_per_token() < mha.linear_flops_per_token()

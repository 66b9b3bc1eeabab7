"""FLOPs counting: closed forms against published figures and against FlopCounterMode on
real HF / diffusers modules built from configs on the meta device."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain_ds.cost import flop_count
from disttrain_ds.cost.flop_count import clear_flops_cache, measure_module_flops, unet_flops
from disttrain_ds.cost.flops import (
    llm_flops_packed,
    llm_flops_per_token,
    projector_flops_per_token,
    training_flops,
    vit_flops,
)


def megatron_shape(h: int, layers: int, vocab: int, seq: int) -> dict:
    """Megatron-LM's GPT: 4h non-gated MLP, no GQA, full attention."""
    return dict(layers=layers, hidden=h, ffn_hidden=4 * h, heads=h // 128, kv_heads=h // 128,
                vocab=vocab, seq_len=seq, gated_mlp=False, causal=False)


# GPT-3 175B and the 1T model of Narayanan et al. 2021, Table 1.
MEGATRON_MODELS = [(12288, 96, 51200, 2048, 1536), (25600, 128, 51200, 2048, 3072)]


@pytest.mark.parametrize("h,l,V,s,B", MEGATRON_MODELS)
def test_megatron_convention_matches_korthikanti_72_formula_without_recompute(h, l, V, s, B):
    """Published: Korthikanti et al. 2022 ("Reducing Activation Recomputation"), model FLOPs
    per iteration without recomputation 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))."""
    ours = llm_flops_per_token(**megatron_shape(h, l, V, s)) * B * s
    published = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert ours == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("h,l,V,s,B", MEGATRON_MODELS)
def test_megatron_convention_plus_recompute_matches_narayanan_96_formula(h, l, V, s, B):
    """Published: Narayanan et al. 2021, eq. 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per
    iteration with full recomputation = our training FLOPs + one more forward of the
    transformer layers (the LM head is not recomputed; that is why its term differs from
    the 72 form's V/(12lh))."""
    shape = megatron_shape(h, l, V, s)
    train = llm_flops_per_token(**shape)
    layers_forward = llm_flops_per_token(**shape, mode="frozen") - 2 * h * V
    published = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert (train + layers_forward) * B * s == pytest.approx(published, rel=0.01)


def test_llama2_7b_short_sequence_is_within_3_percent_of_6N():
    """Published: 6*N FLOPs per training token (Kaplan et al. 2020), N = 6.74e9 for Llama-2-7B
    (Touvron et al. 2023). Ours is ~1.7% lower: the input embedding has parameters but
    no matmul."""
    ours = llm_flops_per_token(layers=32, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32,
                               vocab=32000, seq_len=128)
    assert ours / (6 * 6.74e9) == pytest.approx(1.0, abs=0.03)


# Published: timm model cards, GMACs per 224x224 image forward:
# vit_base_patch16_224 17.6, vit_large_patch16_224 61.6, vit_huge_patch14_224 167.4.
TIMM_VITS = [("B/16", 12, 768, 16, 17.6), ("L/16", 24, 1024, 16, 61.6), ("H/14", 32, 1280, 14, 167.4)]


@pytest.mark.parametrize("name,layers,hidden,patch,gmacs", TIMM_VITS)
def test_vit_forward_macs_match_timm_model_card_within_3_percent(name, layers, hidden, patch, gmacs):
    patches = (224 // patch) ** 2
    fwd = vit_flops(layers=layers, hidden=hidden, ffn_hidden=4 * hidden,
                    patches_per_image=[patches], patch_size=patch, mode="frozen")
    assert fwd / 2 / 1e9 == pytest.approx(gmacs, rel=0.03), name


LLAMA = dict(layers=2, hidden=128, ffn_hidden=352, heads=8, kv_heads=2, vocab=1000)


@pytest.mark.parametrize("mode", ["frozen", "train"])
def test_llm_closed_form_equals_flop_counter_on_hf_llama_with_gqa(mode):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        ids = torch.zeros(2, 64, dtype=torch.long)
    measured = measure_module_flops(model, (ids,), mode=mode)
    # SDPA's math path computes the full score matrix even under a causal mask.
    ours = llm_flops_per_token(**LLAMA, seq_len=64, causal=False, mode=mode) * 2 * 64
    assert measured == pytest.approx(ours, rel=0.01)


def test_causal_attention_counts_the_lower_triangle_including_diagonal():
    s, h, l = 1024, 128, 2
    full = llm_flops_per_token(**LLAMA, seq_len=s, causal=False)
    causal = llm_flops_per_token(**LLAMA, seq_len=s)
    attn_full_per_token = 3 * l * 4 * h * s
    assert full - causal == pytest.approx(attn_full_per_token * (1 - (s + 1) / (2 * s)))


def test_gqa_shrinks_only_kv_projections_and_gating_adds_one_mlp_matrix():
    base = dict(layers=4, hidden=512, ffn_hidden=1024, heads=8, vocab=100, seq_len=16)
    head_dim = 64
    mha = llm_flops_per_token(**base, kv_heads=8)
    gqa = llm_flops_per_token(**base, kv_heads=2)
    assert mha - gqa == pytest.approx(3 * 4 * 2 * 2 * 512 * head_dim * (8 - 2))
    plain = llm_flops_per_token(**base, kv_heads=8, gated_mlp=False)
    assert mha - plain == pytest.approx(3 * 4 * 2 * 512 * 1024)


def test_packed_sequence_counts_attention_per_document():
    docs = [100, 30, 2]
    packed = llm_flops_packed(**LLAMA, doc_lens=docs)
    separate = sum(llm_flops_per_token(**LLAMA, seq_len=n) * n for n in docs)
    assert packed == pytest.approx(separate)
    assert packed < llm_flops_per_token(**LLAMA, seq_len=sum(docs)) * sum(docs)


@pytest.mark.parametrize("mode", ["frozen", "train"])
def test_vit_closed_form_equals_flop_counter_on_hf_vit(mode):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=256, image_size=32, patch_size=8)
    with torch.device("meta"):
        model = ViTModel(cfg, add_pooling_layer=False)
        pixels = torch.empty(2, 3, 32, 32)
    measured = measure_module_flops(model, (pixels,), mode=mode)
    ours = vit_flops(layers=2, hidden=64, ffn_hidden=256, patches_per_image=[16, 16],
                     patch_size=8, mode=mode)
    # Train: the 3x rule also counts an input gradient of the patch conv, which autograd
    # skips when the pixels need no grad (~3.4% here, far less at real sizes).
    assert measured == pytest.approx(ours, rel=0.0 if mode == "frozen" else 0.04)


def test_vit_attention_is_per_image_so_mixed_resolutions_differ_from_their_mean():
    kw = dict(layers=2, hidden=64, ffn_hidden=256, patch_size=16, mode="frozen")
    mixed = vit_flops(**kw, patches_per_image=[16, 256])
    even = vit_flops(**kw, patches_per_image=[136, 136])
    assert mixed - even == pytest.approx(2 * 2 * 2 * 64 * (17**2 + 257**2 - 2 * 137**2))


def test_projector_is_two_matmuls_per_token():
    assert projector_flops_per_token(in_dim=10, hidden_dim=20, out_dim=30, mode="frozen") == 2 * (200 + 600)


def test_training_flops_multiplier_per_mode():
    assert [training_flops(5.0, mode=m) for m in ("train", "frozen_passthrough", "frozen")] == [15.0, 10.0, 5.0]


@pytest.mark.parametrize("call,match", [
    (lambda: training_flops(1.0, mode="eval"), "mode"),
    (lambda: llm_flops_per_token(**{**LLAMA, "kv_heads": 3}, seq_len=8), "kv_heads"),
    (lambda: llm_flops_per_token(**LLAMA, seq_len=0), "seq_len"),
    (lambda: llm_flops_packed(**LLAMA, doc_lens=[]), "doc_lens"),
    (lambda: vit_flops(layers=1, hidden=8, ffn_hidden=8, patches_per_image=[4], patch_size=0), "patch_size"),
    (lambda: measure_module_flops(torch.nn.Linear(2, 2), [torch.ones(2)]), "example_inputs"),
])
def test_bad_arguments_raise_value_error_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# Tiny U-Net, cross-attention at the lower resolution only so convolutions dominate.
UNET = dict(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64),
            layers_per_block=1, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))


def test_unet_flops_grow_about_4x_when_resolution_doubles():
    small = unet_flops(UNET, batch=1, resolution=16, cond_tokens=7, mode="frozen")
    large = unet_flops(UNET, batch=1, resolution=32, cond_tokens=7, mode="frozen")
    # Convs scale exactly 4x with pixels; self-attention grows 16x, so a bit more than 4x.
    assert 4.0 <= large / small < 4.6


def test_unet_measured_backward_matches_the_frozen_module_rule():
    fwd = unet_flops(UNET, batch=1, resolution=16, cond_tokens=7, mode="frozen")
    train = unet_flops(UNET, batch=1, resolution=16, cond_tokens=7, mode="train")
    passthrough = unet_flops(UNET, batch=1, resolution=16, cond_tokens=7, mode="frozen_passthrough")
    assert train == pytest.approx(training_flops(fwd, mode="train"), rel=0.03)
    assert passthrough == pytest.approx(training_flops(fwd, mode="frozen_passthrough"), rel=0.03)


def test_attention_flops_are_counted_on_cpu_as_on_meta():
    """CPU's fused attention kernel has no FLOP formula; measurement must still count it."""
    from diffusers import UNet2DConditionModel

    results = []
    for device in ("meta", "cpu"):
        with torch.device(device):
            unet = UNet2DConditionModel(**UNET)
            inputs = {"sample": torch.zeros(1, 3, 16, 16), "timestep": torch.tensor([3]),
                      "encoder_hidden_states": torch.zeros(1, 5, 32)}
        clear_flops_cache()  # the cache key ignores the device
        results.append(measure_module_flops(unet, inputs, mode="frozen"))
    assert results[0] == results[1] > 0


def test_unet_cache_returns_same_number_without_rerunning(tmp_path, monkeypatch):
    path = tmp_path / "flops.json"
    first = unet_flops(UNET, batch=3, resolution=16, cond_tokens=4, mode="train", cache_path=path)

    def fail(*args, **kwargs):
        raise AssertionError("measurement re-ran despite a cached result")

    monkeypatch.setattr(flop_count, "_count", fail)
    assert unet_flops(UNET, batch=3, resolution=16, cond_tokens=4, mode="train") == first
    clear_flops_cache()  # now only the JSON file can answer
    assert unet_flops(UNET, batch=3, resolution=16, cond_tokens=4, mode="train", cache_path=path) == first
    assert [v["flops"] for v in json.loads(path.read_text()).values()] == [first]
    with pytest.raises(AssertionError, match="re-ran"):
        unet_flops(UNET, batch=3, resolution=32, cond_tokens=4, mode="train", cache_path=path)


def test_module_measurement_is_cached_by_config_and_shapes_and_restores_grads():
    layer = torch.nn.Linear(4, 3)
    layer.weight.requires_grad_(False)
    calls = []
    layer.register_forward_hook(lambda *a: calls.append(1))
    x = torch.ones(5, 4, requires_grad=True)  # input grad counted: the full 3x
    first = measure_module_flops(layer, (x,), mode="train")
    assert measure_module_flops(layer, (x,), mode="train") == first == 3 * 2 * 5 * 4 * 3
    assert len(calls) == 1
    measure_module_flops(layer, (torch.ones(6, 4),), mode="train")
    assert len(calls) == 2
    assert not layer.weight.requires_grad and layer.bias.requires_grad
    assert layer.weight.grad is None and layer.bias.grad is None and x.grad is None

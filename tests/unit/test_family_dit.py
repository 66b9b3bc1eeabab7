"""The DiT generator family: split layers equal diffusers' PixArtTransformer2DModel, pipeline
splits pass tensors that all get gradients, TP shards its blocks, the PixArt-alpha preset's size."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.dit import DIT_PRESETS, FAMILY, HF_RULES, DiTConfig, width
from disttrain_ds.families.dit.model import TP_PLAN, build_pixart, clear_caches
from disttrain_ds.mllm.weights import with_checkpoint
from disttrain_ds.models.layers import Sequential
from disttrain_ds.parallel.tensor_parallel import ColumnParallelLinear, TPContext, shard_layer

CTX = BuildContext(module="generator", seed=0, llm_hidden=64)


def _inputs(cfg: DiTConfig, n: int = 2):
    g = torch.Generator().manual_seed(3)
    cond = torch.randn(n, cfg.query_tokens, cfg.cross_attention_dim, generator=g)
    noisy = torch.randn(n, cfg.in_channels, cfg.resolution, cfg.resolution, generator=g)
    timesteps = torch.tensor([17, 803][:n], dtype=torch.int64)  # different timesteps per image
    return cond, noisy, timesteps


def _ours(cfg: DiTConfig, ctx: BuildContext = CTX, rules=HF_RULES) -> Sequential:
    return Sequential([d.build() for d in with_checkpoint(ctx.module, FAMILY.layers(cfg, ctx), cfg.checkpoint, rules)])


def _saved_pixart(cfg: DiTConfig, path) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)  # not our init seed: equal outputs mean the weights came from the file
        ref = build_pixart(cfg).eval()
    ref.save_pretrained(path)
    return ref


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_layers_loaded_from_save_pretrained_match_diffusers_forward(tmp_path, learn_sigma):
    cfg = DiTConfig(learn_sigma=learn_sigma)
    ref = _saved_pixart(cfg, tmp_path / "pixart")
    loaded = dataclasses.replace(cfg, checkpoint=str(tmp_path / "pixart"))
    cond, noisy, t = _inputs(cfg)
    with torch.no_grad():
        theirs = ref(noisy, encoder_hidden_states=cond, timestep=t, return_dict=False)[0]
        ours = _ours(loaded)((cond, noisy, t))
    assert ours.shape == noisy.shape
    torch.testing.assert_close(ours, theirs[:, : cfg.in_channels], rtol=1e-5, atol=1e-5)
    # Per-image timesteps matter: image 0 alone with image 1's timestep gives another prediction.
    with torch.no_grad():
        swapped = _ours(loaded)((cond[:1], noisy[:1], t[1:]))
    assert (swapped - ours[:1]).abs().max() > 1e-3


def test_negative_controls_dropped_key_rule_or_unloaded_weights_differ(tmp_path):
    cfg = DiTConfig()
    ref = _saved_pixart(cfg, tmp_path / "pixart")
    loaded = dataclasses.replace(cfg, checkpoint=str(tmp_path / "pixart"))
    cond, noisy, t = _inputs(cfg)
    no_blocks = tuple(r for r in HF_RULES if "transformer_blocks" not in r[0])
    with pytest.raises(ValueError, match="no tensor for"):  # a dropped rule is refused, never a partial load
        _ours(loaded, rules=no_blocks)
    with torch.no_grad():
        theirs = ref(noisy, encoder_hidden_states=cond, timestep=t, return_dict=False)[0]
        seeded = _ours(cfg)((cond, noisy, t))  # our own init, nothing read
        other_seed = _ours(cfg, dataclasses.replace(CTX, seed=1))((cond, noisy, t))
    assert (seeded - theirs).abs().max() > 1e-3
    assert (other_seed - seeded).abs().max() > 1e-3


def test_layer_builds_are_deterministic_and_counted_by_the_record():
    cfg = DiTConfig()
    defs = FAMILY.layers(cfg, CTX)
    assert [d.name for d in defs] == ["dit_in", "block0", "block1", "dit_out"]
    assert len(defs) == FAMILY.layer_count(cfg)
    a, b = defs[1].build(), defs[1].build()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert width(cfg) == FAMILY.width(cfg) == cfg.cross_attention_dim
    assert FAMILY.tp_sizes(cfg, "model.generator", 64) == [("model.generator.heads", cfg.heads)]


@pytest.mark.parametrize("split", [1, 2, 3])
def test_every_split_passes_tensors_that_all_get_gradients(split):
    cfg = DiTConfig()
    layers = [d.build() for d in FAMILY.layers(cfg, CTX)]
    cond, noisy, t = _inputs(cfg)
    cond.requires_grad_(True)  # the projector's output: needs a gradient too
    head = Sequential(layers[:split])((cond, noisy, t))
    assert isinstance(head, tuple) and all(isinstance(x, torch.Tensor) for x in head)
    # What DeepSpeed's pipeline does at a stage boundary: fresh leaves for the floating tensors.
    sent = tuple(x.detach().requires_grad_(True) if x.is_floating_point() else x for x in head)
    out = Sequential(layers[split:])(sent)
    assert isinstance(out, torch.Tensor) and out.shape == noisy.shape
    out.square().mean().backward()
    for i, x in enumerate(sent):
        if x.is_floating_point():
            assert x.grad is not None and x.grad.abs().sum() > 0, f"split {split}: tensor {i} got no gradient"
    if split == 1:
        assert [x.dtype for x in sent] == [torch.float32] * 4  # hidden, t_mod, t_emb, cond


def test_tensor_parallel_shards_block_attention_and_mlp():
    block = FAMILY.layers(DiTConfig(), CTX)[1].build()
    attn = block.block.attn1
    assert any(isinstance(attn, cls) for cls, _ in TP_PLAN) and any(isinstance(block.block.ff, cls) for cls, _ in TP_PLAN)
    full_q = attn.to_q.weight.detach().clone()
    heads = attn.heads
    shard_layer(block, TPContext(None, 1, 2))
    q = block.block.attn1.to_q
    assert isinstance(q, ColumnParallelLinear)
    assert torch.equal(q.weight.detach(), full_q[full_q.shape[0] // 2 :])
    assert block.block.attn1.heads == heads // 2 and block.block.attn2.heads == heads // 2
    assert isinstance(block.block.ff.net[0].proj, ColumnParallelLinear)


def test_pixart_alpha_512_preset_has_pixart_alphas_size():
    from diffusers import PixArtTransformer2DModel

    cfg = DiTConfig(**DIT_PRESETS["pixart-alpha-512"])
    try:
        with torch.device("meta"):
            ours = sum(p.numel() for d in FAMILY.layers(cfg, CTX) for p in d.build().parameters())
            # The published model (diffusers PixArt-alpha 512 config), caption projection included.
            full = PixArtTransformer2DModel(
                num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                cross_attention_dim=1152, sample_size=64, patch_size=2, caption_channels=4096)
    finally:
        clear_caches()  # never leave a meta model in the build cache
    caption = sum(p.numel() for p in full.caption_projection.parameters())
    assert ours == sum(p.numel() for p in full.parameters()) - caption
    assert abs(ours - 611e6) / 611e6 < 0.02
    assert len(FAMILY.layers(cfg, CTX)) == FAMILY.layer_count(cfg) == 30


def test_record_imports_no_torch():
    code = "import sys, disttrain_ds.families.dit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_forward_flops_formula_matches_counted_flops():
    from diffusers.models.attention_processor import Attention, AttnProcessor
    from torch.utils.flop_counter import FlopCounterMode

    from disttrain_ds.families.dit import forward_flops

    for cfg in (DiTConfig(), DiTConfig(heads=4, head_dim=16, layers=3, resolution=32, patch_size=4, query_tokens=7,
                                       cross_attention_dim=48, learn_sigma=True)):
        model = _ours(cfg)
        for m in model.modules():  # attention as explicit matmuls, which the counter sees
            if isinstance(m, Attention):
                m.set_processor(AttnProcessor())
        cond, noisy, t = _inputs(cfg, n=1)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model((cond, noisy, t))
        assert forward_flops(cfg) == counter.get_total_flops()

"""U-Net formulas that need no network code: training FLOPs of an image, cost-model terms,
activation bytes (what the MFU meter, data balancing and the memory estimate read)."""

from __future__ import annotations

from disttrain_ds.cost.activations import FP32, LayerBytes, SampleShape
from disttrain_ds.families.unet.config import GeneratorConfig


def image_flops(cfg: GeneratorConfig, mode: str) -> float:
    """Training FLOPs of one generated image in ``mode`` (train | frozen_passthrough | frozen):
    the U-Net has no trusted closed form, so one image is counted once (cached) on the meta device."""
    # deferred: loads torch (diffusers too)
    from disttrain_ds.cost.flop_count import unet_flops  # torch and diffusers: only when a meter asks
    from disttrain_ds.families.unet.model import unet_kwargs

    return unet_flops(unet_kwargs(cfg), batch=1, resolution=cfg.resolution, cond_tokens=cfg.query_tokens, mode=mode)


def cost_terms(cfg: GeneratorConfig) -> dict[str, float]:
    """``CostModel`` generator coefficients of one denoising step (:meth:`UNetDims.per_latent_flops`);
    generated samples already have the U-Net's input size (no VAE), so ``gen_downsample`` is 1."""
    # deferred: loads torch
    from disttrain_ds.cost.model import UNetDims  # numpy and scipy: only when a cost model is built

    per_latent, per_latent_sq = UNetDims(
        channels=tuple(cfg.block_out_channels),
        attention=tuple("CrossAttn" in t for t in cfg.down_block_types),
        blocks_down=cfg.layers_per_block,
        blocks_up=cfg.layers_per_block + 1,
    ).per_latent_flops()
    return {"gen_per_image": 0.0, "gen_per_latent": per_latent, "gen_per_latent_sq": per_latent_sq,
            "gen_downsample": 1}


def _resnet(cin: int, cout: int, pixels: int, b: int) -> float:
    """A diffusers ResnetBlock2D: GroupNorm, SiLU and conv inputs on both halves."""
    return (3 * cin + 3 * cout) * pixels * b


def _transformer(c: int, pixels: int, cond: int, cross: int, heads: int, b: int) -> float:
    """A diffusers Transformer2DModel with one BasicTransformerBlock (self-, cross-attention, GEGLU)."""
    per_pixel = 2 + 6 + 4 + 18 + 1  # norm+proj_in, self-attention, cross-attention, GEGLU FF, proj_out
    # ... and both attentions' float32 log-sum-exp per head and query
    return per_pixel * c * pixels * b + 2 * heads * FP32 * pixels + 3 * cross * cond * b


def activation_layers(cfg: GeneratorConfig, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Generator: output projector, then the U-Net: in, down blocks, mid, up blocks, out; per sample."""
    n, lpb, ch = len(cfg.block_out_channels), cfg.layers_per_block, cfg.block_out_channels
    k, cross, r, c_in = cfg.query_tokens, cfg.cross_attention_dim, cfg.resolution, cfg.in_channels

    def px(level: int) -> int:
        return (r // 2**level) ** 2

    def heads(level: int) -> int:  # diffusers' U-Net reads attention_head_dim as heads per level
        return cfg.attention_head_dim[level]

    def attn(c: int, level: int, kind: str) -> float:
        return _transformer(c, px(level), k, cross, heads(level), b) if "CrossAttn" in kind else 0.0

    def on_slices(c: int, level: int, kind: str) -> float:
        # A transformer model on sequence slices keeps its GroupNorm's and projections' inputs, and
        # its block's three LayerNorms' inputs and float32 statistics, for this rank's slice only
        # (tests/unit/test_memory_sliced.py).
        return (6 * c * b + 6 * FP32) * px(level) if "CrossAttn" in kind else 0.0

    def split(cout: int, level: int, resnets: int, transformers: int) -> float:
        # TP splits a ResNet's second half (the GroupNorm, SiLU and conv2 inputs) and, per
        # transformer block, what its column-parallel linears make: self-attention's q, k, v and
        # output, cross-attention's q and output (per pixel) and keys and values of the condition,
        # the GEGLU's projection, GELU and product, and the attentions' log-sum-exp per head
        # (tests/unit/test_memory_sliced.py).
        per_transformer = (22 * cout * px(level) + 2 * k * cout) * b + 2 * heads(level) * FP32 * px(level)
        return resnets * 3 * cout * px(level) * b + transformers * per_transformer

    cond = k * cross + 4 * ch[0]  # conditioning and time embedding travel with every U-Net layer
    skips = [ch[0] * px(0)]
    saved = [k * (llm_hidden + 2 * cross) * b, c_in * px(0) * b]
    sliced, sharded = [0.0, 0.0], [0.0, 0.0]
    outputs = [(k * cross + c_in * px(0)) * b, (cond + 2 * ch[0] * px(0)) * b]
    for i, kind in enumerate(cfg.down_block_types):
        cin, cout, total = ch[max(i - 1, 0)], ch[i], 0.0
        sliced.append(lpb * on_slices(cout, i, kind))
        sharded.append(split(cout, i, lpb, lpb * ("CrossAttn" in kind)))
        for j in range(lpb):
            total += _resnet(cin if j == 0 else cout, cout, px(i), b) + attn(cout, i, kind)
            skips.append(cout * px(i))
        if i < n - 1:  # downsampling conv
            total += cout * px(i) * b
            skips.append(cout * px(i + 1))
        saved.append(total)
        outputs.append((cond + skips[-1] + sum(skips)) * b)
    c = ch[-1]
    saved.append(2 * _resnet(c, c, px(n - 1), b) + attn(c, n - 1, "CrossAttn"))
    sliced.append(on_slices(c, n - 1, "CrossAttn"))
    sharded.append(split(c, n - 1, 2, 1))
    outputs.append(outputs[-1])
    rev, prev = list(reversed(ch)), ch[-1]
    for i, kind in enumerate(cfg.up_block_types):
        level, cout, cin = n - 1 - i, rev[i], rev[min(i + 1, n - 1)]
        total = 0.0
        sliced.append((lpb + 1) * on_slices(cout, level, kind))
        sharded.append(split(cout, level, lpb + 1, (lpb + 1) * ("CrossAttn" in kind)))
        for j in range(lpb + 1):
            skip = cin if j == lpb else cout
            total += _resnet((prev if j == 0 else cout) + skip, cout, px(level), b) + attn(cout, level, kind)
            skips.pop()
        last = i == n - 1
        total += 0.0 if last else cout * px(level - 1) * b  # upsampling conv input
        saved.append(total)
        sample = cout * px(level if last else level - 1)
        outputs.append((sample + (0 if last else cond + sum(skips))) * b)
        prev = cout
    saved.append(3 * ch[0] * px(0) * b)  # GroupNorm, SiLU and conv_out inputs
    sliced.append(0.0)
    sharded.append(0.0)
    outputs.append(c_in * px(0) * b)
    g = shape.gen_images
    return LayerBytes([x * g for x in saved], [x * g for x in outputs], (k * llm_hidden + c_in * px(0)) * b * g,
                      sharded=[x * g for x in sharded], sliced=[x * g for x in sliced])

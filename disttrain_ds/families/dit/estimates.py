"""DiT formulas that need no network code: forward FLOPs, cost-model terms, activation bytes.

Everything follows from the config's shapes (``N = (resolution / patch_size)**2`` tokens per image,
``D = heads x head_dim``), so the MFU meter, data balancing and the memory estimate read them
without building the model.
"""

from __future__ import annotations

from disttrain_ds.cost.activations import FP32, LayerBytes, SampleShape
from disttrain_ds.cost.flops import training_flops
from disttrain_ds.families.dit.config import DiTConfig


def tokens(cfg: DiTConfig) -> int:
    """Patch tokens of one generated image."""
    return (cfg.resolution // cfg.patch_size) ** 2


def flops_terms(cfg: DiTConfig) -> tuple[int, int, int]:
    """Forward FLOPs of one image as (per image, per token, per squared token count): matmuls,
    attention and the patch convolution, 2 per multiply-add. The split is what the cost model's
    generator terms are (a token is one ``patch_size``-sided patch)."""
    d, p, c = cfg.heads * cfg.head_dim, cfg.patch_size, cfg.in_channels
    k, x = cfg.query_tokens, cfg.cross_attention_dim
    per_image = 2 * (256 * d + d * d + 6 * d * d)  # timestep MLP + adaLN-single
    per_image += cfg.layers * 2 * 2 * k * x * d  # cross-attention k, v of the condition
    patch = 2 * d * c * p * p  # patch embedding
    self_attn = 2 * 4 * d * d  # q, k, v, out
    cross_attn = 2 * 2 * d * d + 2 * 2 * k * d  # q, out; scores and weighted sum over K condition tokens
    mlp = 2 * 2 * d * 4 * d
    head = 2 * d * p * p * c * (2 if cfg.learn_sigma else 1)
    per_token = patch + cfg.layers * (self_attn + cross_attn + mlp) + head
    per_token_sq = cfg.layers * 2 * 2 * d  # self-attention scores and weighted sum
    return per_image, per_token, per_token_sq


def forward_flops(cfg: DiTConfig) -> float:
    """Forward FLOPs of one image (matmuls, attention and the patch convolution; 2 per multiply-add),
    from the shapes alone: what a cost model or MFU meter needs without building the model."""
    a, b, c = flops_terms(cfg)
    n = tokens(cfg)
    return float(a + b * n + c * n * n)


def image_flops(cfg: DiTConfig, mode: str) -> float:
    """Training FLOPs of one generated image in ``mode`` (train | frozen_passthrough | frozen)."""
    return training_flops(forward_flops(cfg), mode=mode)


def cost_terms(cfg: DiTConfig) -> dict[str, float]:
    """``CostModel`` generator coefficients: forward FLOPs per image, per token and per squared token
    count, with ``gen_downsample = patch_size`` so the model's "latent pixels" are the DiT's tokens;
    an image at ``cfg.resolution`` then costs exactly ``forward_flops(cfg)``."""
    a, b, c = flops_terms(cfg)
    return {"gen_per_image": float(a), "gen_per_latent": float(b), "gen_per_latent_sq": float(c),
            "gen_downsample": cfg.patch_size}


def activation_layers(cfg: DiTConfig, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Per-sample bytes of the projector, dit_in, the blocks and dit_out, at ``b`` bytes per element.

    What autograd keeps, per token of width D: a block's self-attention half keeps the LayerNorm
    input (and its float32 mean and rstd), the normed input the modulation multiplies, the
    modulated input q, k and v read, q, k, v, the attention output (also ``to_out``'s input: the
    kernel lays it out token-major) and its log-sum-exp, and the output the gate multiplies (8 D);
    cross-attention keeps its query input, q, the output and its log-sum-exp (3 D; k, v and the
    condition they come from per condition token); the MLP half keeps the LayerNorm input and
    output, the modulated fc1 input, the GELU input, the fc2 input and the output the gate
    multiplies (12 D). Exact on CPU in float32 (``tests/unit/test_memory.py``).

    On sequence slices (``models/diffusers_tp.py``) each TP rank keeps for its slice only: both
    LayerNorms' inputs and float32 statistics, the normed values the modulations multiply and the
    two branch outputs the gates multiply (6 D); the gathered whole rows the GEMMs read stay whole
    (measured in ``tests/unit/test_memory_sliced.py``); dit_out keeps its slice's LayerNorm input and
    statistics, modulated values and projection input. Between layers the tokens are slices, the
    condition and modulation whole; dit_out joins the projected patches.
    """
    d, h, c = cfg.heads * cfg.head_dim, cfg.heads, cfg.in_channels
    n, k, x, r = tokens(cfg), cfg.query_tokens, cfg.cross_attention_dim, cfg.resolution
    block = ((8 + 3 + 12) * d * b + (2 + h + h + 2) * FP32) * n + (x + 2 * d) * k * b
    block += 8 * d * b  # the [6 D] modulation the gates read, 1 + scale twice
    dit_in = c * r * r * b + (256 + 4 * d) * b  # pixels the patch convolution reads; timestep MLP
    dit_out = (3 * d * b + 2 * FP32) * n + d * b  # LayerNorm in/out, proj_out input; 1 + scale
    projector = k * (llm_hidden + 2 * x) * b  # fc1 input, GELU input, fc2 input
    carried = n * d + 6 * d + d + k * x  # hidden, t_mod, t_emb, cond
    sliced = (6 * d * b + 4 * FP32) * n
    head_sliced = (3 * d * b + 2 * FP32) * n  # dit_out's norm, modulation and projection on the slice
    saved = [projector, dit_in, *[block] * cfg.layers, dit_out]
    outputs = [k * x * b, carried * b, *[carried * b] * (cfg.layers - 1), (n * d + d) * b, c * r * r * b]
    g = shape.gen_images
    return LayerBytes([s * g for s in saved], [o * g for o in outputs], (k * llm_hidden + c * r * r) * b * g,
                      sliced=[0.0, 0.0, *[sliced * g] * cfg.layers, head_sliced * g],
                      sliced_outputs=[0.0, *[n * d * b * g] * (cfg.layers + 1), 0.0])

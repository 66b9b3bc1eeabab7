"""ViT-family activation bytes: patch embedding, blocks, head, input projector, per sample."""

from __future__ import annotations

from disttrain_ds.cost.activations import FP32, LayerBytes, SampleShape


def encoder_activations(cfg, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Encoder: patch embedding, ViT blocks, head (norm, CLS dropped), input projector; per sample."""
    e, fe, a, p = cfg.hidden_size, cfg.ffn_hidden, cfg.heads, cfg.patch_size
    tokens = shape.patches + shape.images  # one CLS token per image
    pixels = 3 * p * p * shape.patches * b  # the patches the convolution reads
    # Per token: two LayerNorm inputs, normed inputs of q/k/v and the MLP, q, k, v, attention
    # output, GELU input and fc2 input.
    block = ((8 * e + 2 * fe) * b + (a + 4) * FP32) * tokens
    split = ((4 * e + 2 * fe) * b + a * FP32) * tokens  # q, k, v, attention output, MLP hidden
    head = (e * b + 2 * FP32) * tokens
    projector = (e + 2 * llm_hidden) * b * shape.patches  # fc1 input, GELU input, fc2 input
    saved = [pixels, *[block] * cfg.layers, head, projector]
    outputs = [e * b * tokens] * (cfg.layers + 1) + [e * b * shape.patches, llm_hidden * b * shape.patches]
    return LayerBytes(saved, outputs, pixels, [0.0, *[split] * cfg.layers, 0.0, 0.0])

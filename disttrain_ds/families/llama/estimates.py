"""Llama-family activation bytes: embed, decoder blocks, head, per sample."""

from __future__ import annotations

from disttrain_ds.cost.activations import FP32, LayerBytes, SampleShape


def decoder_activations(cfg, shape: SampleShape, b: int) -> LayerBytes:
    """LLM: embed, decoder blocks, head (norm + LM head + cross-entropy), at ``b`` bytes per element."""
    h, f, a, s, v = cfg.hidden_size, cfg.ffn_hidden, cfg.heads, shape.tokens, cfg.vocab_size
    d = cfg.head_dim or h // a
    q, kv = a * d, cfg.kv_heads * d
    # Per token: RMSNorm input kept in float32 plus its normed output, twice (attention, MLP);
    # q, k, v after rotary, cos/sin, attention output; SwiGLU gate, up, silu(gate), down input.
    block = (4 * h + 2 * q + 2 * kv + 2 * d + 4 * f) * b + (2 * h + a + 2) * FP32
    # TP splits q, k, v, the attention output and log-sum-exp, and the MLP's hidden tensors; the
    # norms' inputs and outputs and cos/sin are whole on every rank.
    split = (2 * h + 2 * q + 2 * kv + 4 * f) * b + a * FP32
    # On sequence slices each rank normalises its slice only: both norms' float32 inputs and
    # statistics and their normalised (pre-weight) values split; their weighted outputs are not kept,
    # the gathered whole rows the GEMMs read are (measured in tests/unit/test_memory_sliced.py).
    sliced = (2 * h + 2) * FP32 + 2 * h * b
    head = 2 * h * b + (h + 1) * FP32 + v * FP32  # norm, LM-head input, float32 log-softmax
    saved = [9.0 * s, *[block * s] * cfg.layers, head * s]  # embed: token ids and image mask
    outputs = [h * b * s] * (cfg.layers + 1) + [(v + h) * b * s]  # the head returns logits and states
    return LayerBytes(saved, outputs, 8.0 * s + h * b * (shape.patches + shape.audio_rows),
                      [0.0, *[split * s] * cfg.layers, 0.0], [0.0, *[sliced * s] * cfg.layers, 0.0],
                      [h * b * s] * (cfg.layers + 1) + [0.0])

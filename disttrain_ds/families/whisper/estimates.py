"""Whisper encoder formulas behind the family record: activation bytes per layer, forward FLOPs.

No torch: recipe validation, the memory estimate and the cost model read these. Counts follow
the ViT's (``estimate/activations.py``): the same pre-norm transformer block with a GELU MLP, on
``frames // 2`` rows per clip; the stem keeps the two convolutions' inputs and GELU inputs.
"""

from __future__ import annotations

from disttrain_ds.cost.activations import FP32, LayerBytes, SampleShape


def activation_layers(cfg, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Per-sample bytes of embed, blocks, head and input projector of the audio encoder."""
    e, fe, a, rows = cfg.hidden_size, cfg.ffn_hidden, cfg.heads, shape.audio_rows
    frames = 2 * rows
    mels = cfg.n_mels * frames * b
    # conv1 input, its GELU input and conv2 input (full frame rate), conv2's GELU input (half rate)
    stem = mels + 2 * e * frames * b + e * rows * b
    block = ((8 * e + 2 * fe) * b + (a + 4) * FP32) * rows
    sliced = (2 * e * b + 4 * FP32) * rows  # on slices: both LayerNorms' inputs and statistics
    head = (e * b + 2 * FP32) * rows
    projector = (e + 2 * llm_hidden) * b * rows
    saved = [stem, *[block] * cfg.layers, head, projector]
    outputs = [e * b * rows] * (cfg.layers + 2) + [llm_hidden * b * rows]
    return LayerBytes(saved, outputs, mels, sliced=[0.0, *[sliced] * cfg.layers, 0.0, 0.0],
                      sliced_outputs=outputs[:-2] + [0.0, 0.0])


def cost_terms(cfg) -> dict[str, float]:
    """``CostModel`` audio coefficients: forward FLOPs of the encoder's own layers on one clip of
    ``f`` log-mel frames (even: ``f / 2`` rows) are ``aud_per_clip + aud_per_frame * f +
    aud_per_frame_sq * f**2`` (multiply-adds count 2; the input projector is counted apart)."""
    e, f = cfg.hidden_size, cfg.ffn_hidden
    stem = 2 * 3 * cfg.n_mels * e + 2 * 3 * e * e / 2  # two kernel-3 convolutions: all frames, then rows
    linear = 2 * (4 * e * e + 2 * e * f) / 2  # q, k, v, out; fc1, fc2 on every row
    attention = 2 * 2 * e / 4  # scores and weighted sum over rows x rows
    return {"aud_per_clip": 0.0, "aud_per_frame": float(stem + cfg.layers * linear),
            "aud_per_frame_sq": float(cfg.layers * attention)}


def forward_flops_per_clip(cfg, frames: int) -> float:
    """Forward FLOPs of the encoder's own layers on one clip of ``frames`` (even) log-mel frames
    (``cost_terms``' formula)."""
    t = cost_terms(cfg)
    return t["aud_per_clip"] + t["aud_per_frame"] * frames + t["aud_per_frame_sq"] * frames * frames

"""A Whisper encoder layer on slices of packed clips (tensor parallelism with sequence-sharded
activations): transformers' ``WhisperEncoderLayer`` mapped onto
``models/packed_tp.py::pre_norm_layer`` (its dropouts are off: ``hf_config``), with the layer's
float16 clamp."""

from __future__ import annotations

import torch
from torch import nn

from disttrain_ds.models.packed_tp import pre_norm_layer


def whisper_layer(layer: nn.Module, part: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
    """``WhisperEncoderLayer.forward`` on this rank's slice [s, H] of the padded packed rows."""
    attn = layer.self_attn
    out = pre_norm_layer(part, spans, ctx, norm1=layer.self_attn_layer_norm,
                         qkv=[attn.q_proj, attn.k_proj, attn.v_proj], out=attn.out_proj, head_dim=attn.head_dim, scale=attn.scaling,
                         dropout=attn.dropout if attn.training else 0.0, norm2=layer.final_layer_norm, fc1=layer.fc1,
                         act=layer.activation_fn, fc2=layer.fc2, prescale=True)  # the library scales q first
    if out.dtype == torch.float16:  # as the library's layer: keep float16 activations finite
        limit = torch.finfo(out.dtype).max - 1000
        out = out.clamp(min=-limit, max=limit)
    return out

"""A CLIP or SigLIP tower layer on slices of packed images (tensor parallelism with
sequence-sharded activations): transformers' ``CLIPEncoderLayer`` / ``SiglipEncoderLayer`` mapped
onto ``models/packed_tp.py::pre_norm_layer``."""

from __future__ import annotations

import torch
from torch import nn

from disttrain_ds.models.packed_tp import pre_norm_layer


def tower_layer(layer: nn.Module, part: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
    """The tower layer's forward on this rank's slice [s, H] of the padded packed rows."""
    attn, mlp = layer.self_attn, layer.mlp
    return pre_norm_layer(part, spans, ctx, norm1=layer.layer_norm1, qkv=[attn.q_proj, attn.k_proj, attn.v_proj],
                          out=attn.out_proj, head_dim=attn.head_dim, scale=attn.scale,
                          dropout=attn.dropout if attn.training else 0.0, norm2=layer.layer_norm2, fc1=mlp.fc1,
                          act=mlp.activation_fn, fc2=mlp.fc2)

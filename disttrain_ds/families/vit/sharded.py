"""A ViT layer on slices of packed images (tensor parallelism with sequence-sharded activations):
transformers' ``ViTLayer`` mapped onto ``models/packed_tp.py::pre_norm_layer``, its column-parallel
linears reading whole rows gathered from the slices and its row-parallel linears returning slices."""

from __future__ import annotations

import torch
from torch import nn

from disttrain_ds.models.packed_tp import pre_norm_layer


def vit_layer(layer: nn.Module, part: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
    """``ViTLayer.forward`` on this rank's slice [s, H] of the padded packed rows."""
    attn, mlp = layer.attention, layer.mlp
    return pre_norm_layer(part, spans, ctx, norm1=layer.layernorm_before, qkv=[attn.q_proj, attn.k_proj, attn.v_proj],
                          out=attn.o_proj, head_dim=attn.head_dim, scale=attn.scaling,
                          dropout=attn.attention_dropout if attn.training else 0.0, norm2=layer.layernorm_after,
                          fc1=mlp.fc1, act=mlp.activation_fn, fc2=mlp.fc2, residual_dropout=layer.dropout)

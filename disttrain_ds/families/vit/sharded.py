"""A ViT layer on slices of packed images (tensor parallelism with sequence-sharded activations,
``parallel/tp_sequence.py``): transformers' ``ViTLayer`` with its own modules and math, its
column-parallel linears reading whole rows gathered from the slices and its row-parallel linears
returning slices.

The encoder's activations are packed (``models/packed.py``): every image's rows one after another,
zero rows padding them to a multiple of the TP degree. Norms, residuals and the MLP's activation
work row by row on this rank's slice; attention runs on whole rows, each image within itself (no
mask, as the library's layer), the padding as an item of its own whose output is dropped.

``SlicedVitLayer`` makes ``vit_layer`` a module of its own, so compiled training compiles it in
place: the collectives (``TPSeqContext.column`` / ``row``) run eagerly between its graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disttrain_ds.models.packed import per_item


@torch.compiler.disable  # images grouped by length on the host: eager, as in every block
def attend_items(qkv: torch.Tensor, spans: torch.Tensor, head_dim: int, dropout: float, scale: float) -> torch.Tensor:
    """Each item's rows of ``qkv`` [R, 3 * heads * head_dim] (whole rows, this rank's heads) attending
    within the item -> [R, heads * head_dim]; ``spans``: rows per item."""

    def attend(items: torch.Tensor) -> torch.Tensor:  # [items of one length, length, 3 * heads * d]
        n, length, _ = items.shape
        q, k, v = (t.reshape(n, length, -1, head_dim).transpose(1, 2) for t in items.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale)
        return out.transpose(1, 2).reshape(n, length, -1)

    return per_item(attend, qkv, spans)


def attention(attn: nn.Module, x: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
    """``ViTAttention.forward`` on this rank's slice ``x`` [s, H] -> its slice of the output; ``spans``:
    rows per item of the padded rows."""
    (qkv,) = ctx.column(x, [attn.q_proj, attn.k_proj, attn.v_proj], joined=True)
    out = attend_items(qkv, spans, attn.head_dim, attn.attention_dropout if attn.training else 0.0, attn.scaling)
    return ctx.row(out, attn.o_proj)


def vit_layer(layer: nn.Module, part: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
    """``ViTLayer.forward`` on this rank's slice [s, H] of the padded packed rows."""
    hidden = layer.dropout(attention(layer.attention, layer.layernorm_before(part), spans, ctx)) + part
    (up,) = ctx.column(layer.layernorm_after(hidden), [layer.mlp.fc1])
    return layer.dropout(ctx.row(layer.mlp.activation_fn(up), layer.mlp.fc2)) + hidden


class SlicedVitLayer(nn.Module):
    """``vit_layer`` of one layer as a module (what ``compile_layers`` compiles for a sliced block).
    It holds the layer without registering it, so parameter names, state dicts and hooks stay the
    layer's own."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        object.__setattr__(self, "layer_", layer)  # not a child module: no second name for its weights

    def forward(self, part: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
        return vit_layer(self.layer_, part, spans, ctx)

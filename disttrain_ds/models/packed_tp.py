"""A pre-norm encoder layer (ViT, CLIP, SigLIP) on slices of packed items: tensor parallelism with
sequence-sharded activations (``parallel/tp_sequence.py``) for encoders whose activations travel
packed (``models/packed.py``: every item's rows one after another, zero rows padding them to a
multiple of the TP degree).

The layer's own modules and math, written out: norms, residuals and the MLP's activation work row
by row on this rank's slice; Q/K/V read whole rows gathered from the slices in one GEMM; each item
attends within itself on whole rows (no mask, as the library's encoder layers; the padding an item
of its own whose output is dropped); the row-parallel linears return slices. A family maps its
layer's modules onto ``pre_norm_layer`` (``families/<family>/sharded.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disttrain_ds.models.packed import per_item


@torch.compiler.disable  # items grouped by length on the host: eager, as in every encoder block
def attend_items(qkv: torch.Tensor, spans: torch.Tensor, head_dim: int, dropout: float, scale: float,
                 prescale: bool = False) -> torch.Tensor:
    """Each item's rows of ``qkv`` [R, 3 * heads * head_dim] (whole rows, this rank's heads) attending
    within the item -> [R, heads * head_dim]; ``spans``: rows per item; ``prescale``: the queries
    multiplied by ``scale`` before attention at scale 1 (Whisper's order of operations)."""

    def attend(items: torch.Tensor) -> torch.Tensor:  # [items of one length, length, 3 * heads * d]
        n, length, _ = items.shape
        q, k, v = (t.reshape(n, length, -1, head_dim).transpose(1, 2) for t in items.chunk(3, dim=-1))
        if prescale:
            q = q * scale
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=1.0 if prescale else scale)
        return out.transpose(1, 2).reshape(n, length, -1)

    return per_item(attend, qkv, spans)


def pre_norm_layer(part: torch.Tensor, spans: torch.Tensor, ctx, *, norm1: nn.Module, qkv: list[nn.Module],
                   out: nn.Module, head_dim: int, scale: float, dropout: float, norm2: nn.Module, fc1: nn.Module,
                   act: Callable[[torch.Tensor], torch.Tensor], fc2: nn.Module,
                   residual_dropout: Callable[[torch.Tensor], torch.Tensor] = nn.Identity(),
                   prescale: bool = False) -> torch.Tensor:
    """``x + attn(norm1(x))``, then ``+ fc2(act(fc1(norm2(.))))``, on this rank's slice ``part`` [s, H]
    of the padded packed rows (``spans``: rows per item, the padding last); ``dropout``: the
    attention's probability dropout (0 outside training); ``residual_dropout``: what the layer
    applies to each branch before its residual add; ``prescale``: as ``attend_items``."""
    (joined,) = ctx.column(norm1(part), qkv, joined=True)
    hidden = residual_dropout(ctx.row(attend_items(joined, spans, head_dim, dropout, scale, prescale), out)) + part
    (up,) = ctx.column(norm2(hidden), [fc1])
    return residual_dropout(ctx.row(act(up), fc2)) + hidden


class SlicedLayer(nn.Module):
    """A family's forward on slices, ``forward(layer, part, spans, ctx)``, as a module of its own (what
    ``compile_layers`` compiles for a sliced block). It holds the layer without registering it, so
    parameter names, state dicts and hooks stay the layer's own."""

    def __init__(self, layer: nn.Module, forward: Callable[..., torch.Tensor]):
        super().__init__()
        object.__setattr__(self, "layer_", layer)  # not a child module: no second name for its weights
        self.forward_on_slices = forward

    def forward(self, part: torch.Tensor, spans: torch.Tensor, ctx) -> torch.Tensor:
        return self.forward_on_slices(self.layer_, part, spans, ctx)

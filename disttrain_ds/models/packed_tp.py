"""A pre-norm encoder layer (ViT, CLIP, SigLIP, Whisper) on slices of packed items: tensor parallelism with
sequence-sharded activations (``parallel/tp_sequence.py``) for encoders whose activations travel
packed (``models/packed.py``: every item's rows one after another, zero rows padding them to a
multiple of the TP degree).

The layer's own modules and math, written out: norms, residuals and the MLP's activation work row
by row on this rank's slice; Q/K/V read whole rows gathered from the slices in one GEMM; each item
attends within itself on whole rows (no mask, as the library's encoder layers; the padding an item
of its own whose output is dropped); the row-parallel linears return slices. A family maps its
layer's modules onto ``pre_norm_layer`` (``families/<family>/sharded.py``); its block runs it
through ``on_slices``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disttrain_ds.models.packed import per_item
from disttrain_ds.models.packed_sp import item_spans


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


def on_slices(sliced: Callable[..., torch.Tensor], part: torch.Tensor, counts: torch.Tensor, ctx) -> torch.Tensor:
    """A block's forward on slices, ``sliced(part, spans, ctx)``, on this rank's slice [s, H] of the
    padded packed rows of the items ``counts`` describes (as ``sp_layer`` under SP). A microbatch
    without items has no rows on any rank of the group, so none exchanges."""
    if not part.shape[0]:
        return part
    return sliced(part, item_spans(counts, ctx.tp.size), ctx)

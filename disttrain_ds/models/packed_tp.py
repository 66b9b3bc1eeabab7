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

Without TP the same written-out layer serves items of different lengths on CUDA (``on_items``): its
GEMMs over all packed rows at once (``WholeRows``) and one variable-length attention call
(``models/item_attention.py``), so no item is copied out or back; items all of one length, and every
layer off CUDA, run the library's layer per length (``per_item``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disttrain_ds.models.item_attention import attend_items
from disttrain_ds.models.layers import stacked_bias
from disttrain_ds.models.packed import host_sizes, per_item
from disttrain_ds.models.packed_sp import item_spans


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


class WholeRows:
    """``pre_norm_layer``'s context for packed rows whole on this rank (no TP): the layer's own
    GEMMs over all rows, no collectives; q, k and v from one GEMM of their stacked weights."""

    @staticmethod
    def column(x: torch.Tensor, linears: list[nn.Module], joined: bool = False) -> list[torch.Tensor]:
        if not joined:
            return [m(x) for m in linears]
        return [F.linear(x, torch.cat([m.weight for m in linears]), stacked_bias(linears, x))]

    @staticmethod
    def row(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        return linear(x)


def on_items(sliced: Callable[..., torch.Tensor], layer: Callable[[torch.Tensor], torch.Tensor],
             hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A block's forward without TP on packed rows [R, H] of the items ``counts`` describes: on CUDA,
    where their lengths differ, the written-out layer ``sliced(hidden, spans, WholeRows)`` over all
    rows (attention in one call, ``models/item_attention.py``); else the library's ``layer`` per length
    (``per_item``)."""
    sizes = host_sizes(counts)
    if varlen_items(hidden, sizes):
        return sliced(hidden, torch.tensor(sizes, dtype=torch.long), WholeRows)
    return per_item(layer, hidden, counts)


def varlen_items(hidden: torch.Tensor, sizes: list[int]) -> bool:
    """Whether ``on_items`` runs all rows at once: on CUDA, items of different lengths."""
    return hidden.is_cuda and len(set(sizes)) > 1

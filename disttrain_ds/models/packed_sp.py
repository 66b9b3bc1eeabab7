"""Ulysses sequence parallelism over packed items: an encoder's images or audio clips.

An encoder's activations travel packed (``models/packed.py``): [rows of all items, width] plus one
count per item. Under SP each rank of the group holds one contiguous 1/SP slice of those rows
(zero rows pad them to a multiple of SP), whichever items the rows belong to: layer norms and MLPs
work row by row, so only attention needs whole items. Around it the slice is exchanged for 1/SP
of the heads over every row (``SPContext.heads_to_seq``), each item attends within itself (no
mask, no causality, as the library's encoder layer), and a second exchange trades back. The
padding rows form an item of their own, whose output is dropped.

The embedding computes every row on every rank and keeps its slice (``shard_rows``); the head
gathers the slices back (``gather_rows``), so what the module sends on is whole on every rank.

The SP context is duck-typed (``parallel/sequence_parallel.py::SPContext``): this file holds no
process group of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from disttrain_ds.models.packed import host_sizes, per_item

ITEM_ATTENTION = "disttrain_items"
"""Name of ``item_attention`` among transformers' attention implementations."""
_ITEMS = "_packed_items_sp"
"""Attribute of an attention module holding (item spans, SP context) while ``sp_layer`` runs it."""


def padded_rows(rows: int, size: int) -> int:
    """``rows`` rounded up to a multiple of the SP degree ``size``."""
    return -(-rows // size) * size


def shard_rows(hidden: torch.Tensor, sp) -> torch.Tensor:
    """This rank's slice of the packed rows [rows, width], zero rows appended to a multiple of SP."""
    rows = hidden.shape[0]
    pad = padded_rows(rows, sp.size) - rows
    if pad:
        hidden = torch.cat([hidden, hidden.new_zeros((pad, *hidden.shape[1:]))])
    return sp.shard(hidden, dim=0)


def gather_rows(part: torch.Tensor, rows: int, sp) -> torch.Tensor:
    """Every rank's slice joined, the padding dropped: the packed [rows, width] on every rank."""
    return sp.gather(part, dim=0)[:rows]


def item_spans(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Rows per item of the padded rows: the items' own counts, then the padding as one more item
    (on the CPU, where ``per_item`` reads them; ``counts`` read from the device once per microbatch)."""
    sizes = host_sizes(counts)
    pad = padded_rows(sum(sizes), size) - sum(sizes)
    return torch.tensor(sizes + [pad] if pad else sizes, dtype=torch.long)


def item_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                   dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface for a slice of packed items: q, k, v [1, H, S/SP, D] (this
    rank's rows) -> [1, S/SP, H, D], every row attending to all rows of its own item. The items and
    the SP context ride on the attention module (``_ITEMS``, set by ``sp_layer``): not every
    library layer passes keyword arguments through to its attention function."""
    spans, sp = getattr(module, _ITEMS, (None, None))
    if attention_mask is not None or sp is None:
        raise ValueError(f"{ITEM_ATTENTION} attention runs inside sp_layer, with no attention_mask")
    query, key, value = sp.heads_to_seq(query, key, value)  # [1, H/SP, S, D]
    _, h, s, d = query.shape
    rows = torch.cat([t[0].transpose(0, 1).reshape(s, h * d) for t in (query, key, value)], dim=-1)

    def attend(x: torch.Tensor) -> torch.Tensor:  # [items of one length, length, 3 H/SP D]
        n, length, _ = x.shape
        q, k, v = (t.reshape(n, length, h, d).transpose(1, 2) for t in x.split(h * d, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)
        return o.transpose(1, 2).reshape(n, length, h * d)

    out = per_item(attend, rows, spans).reshape(1, s, h, d)
    return sp.seq_to_heads(out), None


ALL_ATTENTION_FUNCTIONS.register(ITEM_ATTENTION, item_attention)


@contextmanager
def _items_attention(layer: nn.Module, spans: torch.Tensor, sp) -> Iterator[None]:
    """The layer's attention modules (those holding a transformers config) call ``item_attention``
    with ``spans`` and ``sp`` while inside; their configs and attributes are restored on the way out
    (each block holds its own copy of its config, so no other layer is touched)."""
    attns = [m for m in layer.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    saved = [m.config._attn_implementation for m in attns]
    for m in attns:
        m.config._attn_implementation = ITEM_ATTENTION
        setattr(m, _ITEMS, (spans, sp))
    try:
        yield
    finally:
        for m, impl in zip(attns, saved):
            m.config._attn_implementation = impl
            delattr(m, _ITEMS)


def sp_layer(layer: nn.Module, part: torch.Tensor, counts: torch.Tensor, sp) -> torch.Tensor:
    """One library encoder layer (called as ``layer(hidden, attention_mask)``) on this rank's slice
    [S/SP, width] of the packed rows of the items ``counts`` describes."""
    spans = item_spans(counts, sp.size)
    if not int(spans.sum()):  # no item in this microbatch: every rank of the group knows, none exchanges
        return part
    with _items_attention(layer, spans, sp):
        out = layer(part.unsqueeze(0), None)
    return out[0]

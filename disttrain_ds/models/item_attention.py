"""Attention over packed items (an encoder's images or audio clips, rows one item after another):
each row attends to every row of its own item, as the library's encoder layer attends within one
image. ``attend_items`` takes the rows' joined q, k, v and runs one of three paths that compute the
same function (``items_path`` chooses):

- varlen: flash attention over variable-length sequences (``doc_mask.flash_spans``, the LLM's
  documents' call too), one call for all items from their offsets; CUDA, half precision;
- flex: compiled flex attention under a block mask of the items (``doc_block_mask(causal=False)``),
  one call, compiled for dynamic lengths so a new mix of sizes does not recompile; CUDA in float32;
- groups: SDPA per length, items of one length batched (``models/packed.py::per_item``: a view where
  every item has one length, else copies out and back); off CUDA (neither kernel has a backward
  there), where every item has one length, and where attention dropout is asked for.

The offsets and the block mask are built once per microbatch from the item lengths on the host
(read once per microbatch): every block of a stage attends the same items, and nothing here reads
back from the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from disttrain_ds.models.doc_mask import FLASH_DTYPES, doc_block_mask, flash_spans, flex_kernel, span_offsets
from disttrain_ds.models.packed import per_item


def items_path(sizes: list[int], dropout: float, device: torch.device, dtype: torch.dtype) -> str:
    """How ``attend_items`` attends items of ``sizes`` rows (module docstring)."""
    if device.type != "cuda" or dropout or len(set(sizes)) <= 1:
        return "groups"
    return "varlen" if dtype in FLASH_DTYPES else "flex"


_TABLES: dict[str, tuple] = {}
"""Per path: (item lengths, device, what the kernel reads of them) of the last microbatch."""


def _table(path: str, sizes: list[int], device: torch.device, build) -> object:
    """``build(item indices or offsets)`` for ``sizes``, reused while the items stay the same."""
    last = _TABLES.get(path)
    if not (last and last[0] == sizes and last[1] == device):
        spans = torch.tensor(sizes, dtype=torch.long).to(device, non_blocking=True)  # no wait on the device
        _TABLES[path] = (sizes, device, build(spans))
    return _TABLES[path][2]


def item_block_mask(sizes: list[int], device: torch.device) -> BlockMask:
    """flex attention's block mask for packed items of ``sizes`` rows."""

    def build(spans: torch.Tensor) -> BlockMask:
        items = torch.repeat_interleave(torch.arange(len(sizes), device=device), spans, output_size=sum(sizes))
        return doc_block_mask(items[None], causal=False)

    return _table("flex", sizes, device, build)


def item_offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """int32 [items + 1]: where each item's rows start, then the row count (flash's cu_seqlens)."""
    return _table("varlen", sizes, device, span_offsets)


def _qkv(qkv: torch.Tensor, head_dim: int) -> list[torch.Tensor]:
    """q, k, v as [R, heads, d] views of the joined rows [R, 3 * heads * d] (no copy)."""
    return list(qkv.view(qkv.shape[0], 3, -1, head_dim).unbind(1))


def _varlen(qkv: torch.Tensor, sizes: list[int], head_dim: int, scale: float) -> torch.Tensor:
    q, k, v = _qkv(qkv, head_dim)
    out = flash_spans(q, k, v, item_offsets(sizes, qkv.device), max(sizes), scale, causal=False)
    return out.reshape(qkv.shape[0], -1)


def _flex(qkv: torch.Tensor, sizes: list[int], head_dim: int, scale: float) -> torch.Tensor:
    q, k, v = (t.transpose(0, 1)[None] for t in _qkv(qkv, head_dim))  # each [1, heads, R, d], strided
    out = flex_kernel(dynamic=True)(q, k, v, block_mask=item_block_mask(sizes, qkv.device), scale=scale)
    return out.transpose(1, 2).reshape(qkv.shape[0], -1)


@torch.compiler.disable  # host-side grouping, or a kernel compiled (or built) on its own
def attend_items(qkv: torch.Tensor, spans: torch.Tensor, head_dim: int, dropout: float, scale: float,
                 prescale: bool = False, path: str | None = None) -> torch.Tensor:
    """Each item's rows of ``qkv`` [R, 3 * heads * head_dim] (whole rows, this rank's heads) attending
    within the item -> [R, heads * head_dim]; ``spans``: rows per item (on the host); ``prescale``:
    the queries multiplied by ``scale`` before attention at scale 1 (Whisper's order of operations;
    the one-call paths scale inside the kernel, equal up to rounding, since a scaled copy of q would
    change its layout); ``path``: "varlen", "flex" or "groups" (None: ``items_path``'s choice)."""
    sizes = spans.tolist()
    path = path or items_path(sizes, dropout, qkv.device, qkv.dtype)
    if path != "groups" and dropout:
        raise ValueError(f"attention over packed items through {path} has no dropout, got {dropout}")
    if path == "varlen":
        return _varlen(qkv, sizes, head_dim, scale)
    if path == "flex":
        return _flex(qkv, sizes, head_dim, scale)

    def attend(items: torch.Tensor) -> torch.Tensor:  # [items of one length, length, 3 * heads * d]
        n, length, _ = items.shape
        q, k, v = (t.reshape(n, length, -1, head_dim).transpose(1, 2) for t in items.chunk(3, dim=-1))
        if prescale:
            q = q * scale
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=1.0 if prescale else scale)
        return out.transpose(1, 2).reshape(n, length, -1)

    return per_item(attend, qkv, sizes)

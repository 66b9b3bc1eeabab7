"""Compile flex attention at start-up instead of inside step 1.

``flex_kernel()`` is ``torch.compile(flex_attention, dynamic=False)``: it compiles at its first
call, one graph per shape, dtype, stride layout and grad mode. Left alone, that first call is in
step 1, where the rank's peers wait on its boundary messages under ``parallel.comm_timeout_s``
(300 s by default) while it compiles. ``warm_up_stage`` runs, before the first step, a forward
and a backward through ``doc_attention`` (the LLM blocks' own path) on dummy tensors laid out as the
blocks will pass them, so the first real call finds its graphs compiled. Off CUDA nothing happens:
document attention there takes the per-span path (flex has no backward on CPU).

Encoder blocks attend packed items of mixed lengths in one call on CUDA (``models/item_attention.py``:
flex compiled for dynamic lengths in float32, varlen flash attention in half precision):
``warm_up_items`` runs each such block's written-out forward and backward on dummy rows of two
items, so the flex kernel and, under ``train.compile``, the block's own graphs are compiled before
the first step as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from disttrain_ds.models.doc_mask import doc_attention, doc_attention_path, doc_block_mask
from disttrain_ds.models.packed_tp import WholeRows
from disttrain_ds.samples import doc_ids


@dataclass(frozen=True)
class FlexShape:
    """What one flex attention call sees on this rank (one graph of the compiled kernel)."""

    batch: int
    """Sequences per microbatch on this rank (the LLM's samples per DP replica)."""
    seq_len: int
    """Positions per sequence (``data.seq_len``: sequences are packed to it)."""
    heads: int
    """Query heads on this rank (the model's over its TP degree)."""
    kv_heads: int
    """Key/value heads on this rank."""
    head_dim: int
    """Width of one head."""
    dtype: torch.dtype
    """The attention's compute dtype (its weights' dtype)."""
    scale: float
    """Softmax scale the attention passes (``head_dim ** -0.5`` for Llama-shaped blocks)."""


def flex_shapes(stage: nn.Module, *, batch: int, seq_len: int, tp: int = 1, sp: int = 1,
                device_type: str = "cuda") -> list[FlexShape]:
    """The distinct shapes flex attention will see in ``stage``: one per LLM block configuration
    whose ``doc_attention`` takes the flex path on ``device_type`` (none on a stage without LLM
    blocks, or where every block runs ``spans``)."""
    device, out = torch.device(device_type), list[FlexShape]()
    for block in stage.modules():
        # A block that attends per document carries its ``doc_attention`` setting (the decoder
        # families' blocks, whichever family built them).
        setting = getattr(block, "doc_attention", None)
        if not isinstance(setting, str) or doc_attention_path(setting, device) != "flex":
            continue
        attn = block.layer.self_attn
        dtype = next(attn.parameters()).dtype
        # Under SP attention sees whole rows with 1/SP of the heads (at least one KV head: repeated).
        kv = max(attn.config.num_key_value_heads // tp // sp, 1)
        shape = FlexShape(batch, seq_len, attn.config.num_attention_heads // tp // sp, kv,
                          attn.head_dim, dtype, float(attn.scaling))
        if shape not in out:
            out.append(shape)
    return out


def _qkv(shape: FlexShape, device: torch.device, grad: bool) -> list[torch.Tensor]:
    """Dummy q, k, v as the block passes them: [B, H, S, D] views of [B, S, H, D] projections (the
    kernel is compiled for this stride layout, not the contiguous one)."""
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(shape.batch, shape.seq_len, h, shape.head_dim, generator=g, device=device, dtype=shape.dtype)
            .transpose(1, 2).requires_grad_(grad) for h in (shape.heads, shape.kv_heads, shape.kv_heads)]


def exercise(shape: FlexShape, device: torch.device, backward: bool = True) -> None:
    """Call ``doc_attention`` through flex for ``shape`` in each grad mode training uses: with
    gradients (and their backward) when ``backward``, else forward with inputs that need none;
    and forward under ``torch.no_grad`` (activation checkpointing's first pass, evaluation)."""
    half = shape.seq_len // 2  # two documents per row (data.seq_len >= 16): a block mask of several runs
    docs = torch.stack([doc_ids((half, shape.seq_len - half), shape.seq_len)] * shape.batch).to(device)
    blocks = doc_block_mask(docs)
    q, k, v = _qkv(shape, device, backward)
    out, _ = doc_attention(None, q, k, v, None, scaling=shape.scale, doc_blocks=blocks)
    if backward:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    with torch.no_grad():
        doc_attention(None, *_qkv(shape, device, False), None, scaling=shape.scale, doc_blocks=blocks)


def warm_up_stage(stage: nn.Module, *, batch: int, seq_len: int, device: torch.device, tp: int = 1,
                  sp: int = 1, backward: bool = True) -> int:
    """Compile flex attention for every shape ``stage``'s LLM blocks will give it (``flex_shapes``),
    before the first step; the number of shapes compiled. A no-op (0) off CUDA. ``batch``: the
    LLM's samples per microbatch on this rank; ``tp``, ``sp``: its TP and SP degrees; ``backward``: whether the
    stage runs backward (its inputs need gradients)."""
    if device.type != "cuda":
        return 0
    shapes = flex_shapes(stage, batch=batch, seq_len=seq_len, tp=tp, sp=sp)
    for shape in shapes:
        exercise(shape, device, backward)
    return len(shapes)


WARM_ITEMS = ([40, 60], [100, 157])
"""Item lengths of the dummy rows: within one flex mask block and over several (a size of 1 is
specialised by the compiler, so each compiles a graph of its own)."""


def exercise_items(block: nn.Module, device: torch.device, backward: bool = True) -> None:
    """Run ``block``'s written-out forward over all rows of items of ``WARM_ITEMS`` lengths (with
    its backward to the rows when ``backward``, else on rows that need no gradient; and under
    ``torch.no_grad``: activation checkpointing's first pass, evaluation), on this rank's weight
    shards without collectives (``WholeRows``): the attention call its rows make on this rank."""
    norm = next(m for m in block.modules() if isinstance(m, nn.LayerNorm))  # a pre-norm layer's first
    for sizes in WARM_ITEMS:
        spans = torch.tensor(sizes)
        rows = torch.randn(sum(sizes), norm.normalized_shape[0], device=device, dtype=norm.weight.dtype)
        if backward:
            rows.requires_grad_()
            out = block.sliced(rows, spans, WholeRows)
            torch.autograd.grad(out, rows, torch.ones_like(out))  # the rows only: no weight gradient
        else:  # a stage that runs no backward: its inputs need no gradient
            block.sliced(rows, spans, WholeRows)
        with torch.no_grad():
            block.sliced(rows.detach(), spans, WholeRows)


def warm_up_items(stage: nn.Module, device: torch.device, backward: bool = True) -> int:
    """Compile the item attention of every encoder block in ``stage`` (``packed_items``) before the
    first step; the number of blocks run. A no-op (0) off CUDA, where items attend per length."""
    if device.type != "cuda":
        return 0
    blocks = [m for m in stage.modules() if getattr(m, "packed_items", False)]
    for block in blocks:
        exercise_items(block, device, backward)
    return len(blocks)

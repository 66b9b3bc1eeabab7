"""diffusers' ``BasicTransformerBlock`` on sequence slices (tensor parallelism with sequence-sharded
activations, ``parallel/tp_sequence.py``): the generators' transformer blocks (PixArt's in the DiT, the
U-Net's) written out with the block's own modules, their column-parallel linears reading whole rows
gathered from the slices and their row-parallel linears returning slices.

diffusers' attention processor reshapes by the shape of its input, which here is a slice, so the
block's forward (``BasicTransformerBlock.forward``, ``AttnProcessor2_0``) is written out for the
settings the families build: ``norm_type`` ``ada_norm_single`` (PixArt: adaLN-single modulation from
the shared ``t_mod``, no norm before the cross-attention, gated branches) or ``layer_norm`` (the
U-Net's: a LayerNorm before each branch); self-attention, cross-attention to the condition, a GELU
or GEGLU MLP. Between blocks each TP rank keeps a contiguous slice of every image's tokens.

The condition (and PixArt's modulation) is whole on every TP rank but each rank's slice reads only
its own tokens' part of it, so its gradient from a block is this rank's part: the family sums it
over the group once, where it enters the blocks (``TPSeqContext.replicated``). Replicated weights
in the block (norms, the modulation table, row-parallel biases) get the TP hook (``tp_seq_region``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU, GELU
from torch import nn

NORM_TYPES = ("ada_norm_single", "layer_norm")
"""``BasicTransformerBlock.norm_type`` values ``basic_block`` computes."""


def block_problems(block: nn.Module) -> list[str]:
    """What in ``block`` the written-out forward does not compute (empty: nothing)."""
    attn1, attn2 = block.attn1, block.attn2
    problems = [
        block.norm_type not in NORM_TYPES and f"norm_type {block.norm_type!r}",
        block.pos_embed is not None and "a positional embedding inside the block",
        block.only_cross_attention and "only_cross_attention",
        attn2 is None and "no cross-attention",
        getattr(block, "fuser", None) is not None and "GLIGEN",
        block._chunk_size is not None and "chunked feed-forward",
        not isinstance(block.ff.net[0], (GELU, GEGLU)) and f"feed-forward activation {type(block.ff.net[0]).__name__}",
        *[(a.norm_q is not None or a.norm_k is not None or a.group_norm is not None or a.spatial_norm is not None
           or a.norm_cross or a.residual_connection or a.rescale_output_factor != 1.0) and "attention extras"
          for a in (attn1, attn2) if a is not None],
    ]
    return [p for p in problems if p]


def check_block(block: nn.Module) -> None:
    """Refuse a block whose settings the written-out forward does not compute."""
    if problems := block_problems(block):
        raise ValueError(f"transformer block on sequence slices: {', '.join(problems)} not supported")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[n, Lq, heads * d] queries on [n, Lk, heads * d] keys / values -> [n, Lq, heads * d]."""
    n, lq, width = q.shape
    d = width // heads
    q, k, v = (t.reshape(n, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # the processor's: default scale, no dropout
    return out.transpose(1, 2).reshape(n, lq, width)


def self_attention(attn: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
    """``attn(x)`` on this rank's slice ``x`` [n, s, D], before the output dropout: q, k, v of whole
    rows (this rank's heads) in one gathered GEMM, the output projection reduce-scattered back to
    the slice. The collective is the function's last call, so compiled code resumes in the block."""
    q, k, v = ctx.column(x, [attn.to_q, attn.to_k, attn.to_v])
    return ctx.row(_attend(q, k, v, attn.heads), attn.to_out[0])


def cross_attention(attn: nn.Module, x: torch.Tensor, cond: torch.Tensor, ctx) -> torch.Tensor:
    """``attn(x, encoder_hidden_states=cond)`` on this rank's slice ``x``: queries of whole rows, keys
    and values of the (whole) condition through this rank's head shards; before the output dropout."""
    (q,) = ctx.column(x, [attn.to_q])
    k, v = (F.linear(cond, m.weight, m.bias) for m in (attn.to_k, attn.to_v))
    return ctx.row(_attend(q, k, v, attn.heads), attn.to_out[0])


def feed_forward(ff: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
    """``ff(x)`` (projection, GELU or GEGLU, dropout, projection) on a slice. A GEGLU projection's
    shard stacks this rank's hidden and gate halves (``col_pairs``), so the halves split as the
    library's do."""
    act, drop, down = ff.net[0], ff.net[1], ff.net[2]
    (up,) = ctx.column(x, [act.proj])
    if isinstance(act, GEGLU):
        hidden, gate = up.chunk(2, dim=-1)
        up = hidden * act.gelu(gate)
    else:
        up = act.gelu(up)
    return ctx.row(drop(up), down)


def basic_block(block: nn.Module, part: torch.Tensor, cond: torch.Tensor, ctx,
                t_mod: torch.Tensor | None = None) -> torch.Tensor:
    """``block(hidden, encoder_hidden_states=cond, timestep=t_mod)`` on this rank's slice ``part``
    [n, s, D] of every image's tokens; ``cond`` [n, K, cross] and PixArt's ``t_mod`` [n, 6 D] whole
    (their gradients from here are this rank's part). Each residual is added first: the sum takes
    its contiguous layout (a pipeline stage sends only contiguous tensors), not the transposed one
    of a reduce-scattered branch; the same sums as the library's."""
    attn1, attn2 = block.attn1, block.attn2
    if block.norm_type == "layer_norm":
        hidden = part + attn1.to_out[1](self_attention(attn1, block.norm1(part), ctx))
        hidden = hidden + attn2.to_out[1](cross_attention(attn2, block.norm2(hidden), cond, ctx))
        return hidden + feed_forward(block.ff, block.norm3(hidden), ctx)
    n = part.shape[0]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        block.scale_shift_table[None] + t_mod.reshape(n, 6, -1)).chunk(6, dim=1)
    x = block.norm1(part) * (1 + scale_msa) + shift_msa
    hidden = part + gate_msa * attn1.to_out[1](self_attention(attn1, x, ctx))
    hidden = hidden + attn2.to_out[1](cross_attention(attn2, hidden, cond, ctx))  # PixArt: no norm before it
    x = block.norm2(hidden) * (1 + scale_mlp) + shift_mlp
    return hidden + gate_mlp * feed_forward(block.ff, x, ctx)

"""A Llama-shaped decoder layer on sequence slices (tensor parallelism with sequence-sharded
activations, ``parallel/tp_sequence.py``): the transformers layer's own modules and math, with its
column-parallel linears reading whole rows gathered from the slices and its row-parallel linears
returning slices.

transformers' attention reshapes its projections by the shape of its input, which here is a slice,
so the attention and MLP forwards are written out: the same operations as ``LlamaAttention`` /
``Qwen2Attention`` (``sliding_window`` where the module has one), ``LlamaMLP`` and
``LlamaDecoderLayer``, with the layer's own rotary function and attention interface.

``models/layers.py::SlicedLayer`` makes ``decoder`` a module of its own, so compiled training
compiles it in place: the collectives (``TPSeqContext.column`` / ``row``) run eagerly between its graphs.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def attention(attn: nn.Module, x: torch.Tensor, ctx, position_embeddings, **kwargs) -> torch.Tensor:
    """``attn.forward`` on this rank's slice ``x`` [B, s, H] -> its slice of the output."""
    q, k, v = ctx.column(x, [attn.q_proj, attn.k_proj, attn.v_proj])  # whole rows, this rank's heads
    b, s = q.shape[:2]
    q, k, v = (t.reshape(b, s, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    library = sys.modules[type(attn).__module__]  # the family's own rotary and default attention
    cos, sin = position_embeddings
    q, k = library.apply_rotary_pos_emb(q, k, cos, sin)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, library.eager_attention_forward)
    if hasattr(attn, "sliding_window"):
        kwargs["sliding_window"] = attn.sliding_window
    out, _ = interface(attn, q, k, v, None, dropout=0.0 if not attn.training else attn.attention_dropout,
                       scaling=attn.scaling, **kwargs)
    return ctx.row(out.reshape(b, s, -1).contiguous(), attn.o_proj)


def mlp(block: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
    """``LlamaMLP.forward`` on a slice: gate and up in one gathered GEMM, down reduce-scattered."""
    gate, up = ctx.column(x, [block.gate_proj, block.up_proj])
    return ctx.row(block.act_fn(gate) * up, block.down_proj)


def decoder(layer: nn.Module, hidden: torch.Tensor, ctx, position_embeddings, **kwargs) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` on this rank's slice of every row (rotary table and attention
    arguments for whole rows)."""
    hidden = hidden + attention(layer.self_attn, layer.input_layernorm(hidden), ctx, position_embeddings, **kwargs)
    return hidden + mlp(layer.mlp, layer.post_attention_layernorm(hidden), ctx)


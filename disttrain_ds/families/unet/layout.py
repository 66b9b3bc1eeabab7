"""The U-Net's transformer blocks return their output in the layout their input came in.

diffusers' ``Transformer2DModel`` turns its token rows back into an image with ``.contiguous()``,
which on a channels-last network (``models/channels_last.py``, the layout cuDNN runs fastest) copies
the whole activation to NCHW; the convolution after it then copies it back to channels-last. The
token rows [n, h * w, c] reshaped to [n, h, w, c] and permuted to NCHW already are a channels-last
tensor, so ``output_in_layout`` makes the copy only where the block's residual input is NCHW, as the
library does. Same values either way; only where they sit in memory differs.
"""

from __future__ import annotations

import types

import torch
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn


def output_in_layout(self: Transformer2DModel, hidden_states: torch.Tensor, residual: torch.Tensor, batch_size: int,
                     height: int, width: int, inner_dim: int) -> torch.Tensor:
    """``Transformer2DModel._get_output_for_continuous_inputs`` with the image laid out as ``residual``."""
    layout = torch.channels_last if residual.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format

    def as_image(rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2).contiguous(memory_format=layout)

    if self.use_linear_projection:
        hidden_states = as_image(self.proj_out(hidden_states))
    else:
        hidden_states = self.proj_out(as_image(hidden_states))
    return hidden_states + residual


def keep_layout(block: nn.Module) -> nn.Module:
    """``block`` (in place) with every ``Transformer2DModel`` in it returning ``output_in_layout``."""
    for m in block.modules():
        if isinstance(m, Transformer2DModel):
            m._get_output_for_continuous_inputs = types.MethodType(output_in_layout, m)
    return block

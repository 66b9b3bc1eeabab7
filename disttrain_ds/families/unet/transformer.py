"""The U-Net's transformer models (diffusers ``Transformer2DModel`` and its ``BasicTransformerBlock``s)
as this family runs them: outputs in their input's memory layout, and on sequence slices under tensor
parallelism. ``adapt`` gives a U-Net block's transformer models these classes in place (subclasses:
the same modules, parameters and names; only methods differ).

**Layout.** diffusers turns the token rows back into an image with ``.contiguous()``, which on a
channels-last network (``models/channels_last.py``, the layout cuDNN runs fastest) copies the whole
activation to NCHW, and the convolution after it copies it back. The rows reshaped to [n, h, w, c]
and permuted to NCHW already are a channels-last image, so the copy is made only where the model's
input was NCHW, as the library makes it. Same values either way.

**Slices.** With a ``tp_seq`` context (``parallel/tp_sequence.py::attach``) each transformer model
keeps this rank's contiguous slice of every image's tokens after its input projection, its blocks
run on slices (``models/diffusers_tp.py::basic_block``: collectives overlapped with the GEMMs), and
the slices are joined again before its output projection. The convolutions around it need their
spatial neighbours and stay replicated over TP, as do the GroupNorm and the projections here.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn

from disttrain_ds.models.diffusers_tp import basic_block, check_block


class UnetTransformer(Transformer2DModel):
    """``Transformer2DModel`` with its output in its input's layout, and slices under ``tp_seq``."""

    tp_seq = None

    def _operate_on_continuous_inputs(self, hidden_states: torch.Tensor):
        rows, inner_dim = super()._operate_on_continuous_inputs(hidden_states)
        return (rows if self.tp_seq is None else self.tp_seq.scatter(rows)), inner_dim

    def _get_output_for_continuous_inputs(self, hidden_states: torch.Tensor, residual: torch.Tensor, batch_size: int,
                                          height: int, width: int, inner_dim: int) -> torch.Tensor:
        if self.tp_seq is not None:
            hidden_states = self.tp_seq.gather(hidden_states)
        fmt = torch.channels_last if residual.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format

        def as_image(rows: torch.Tensor) -> torch.Tensor:
            return rows.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2).contiguous(memory_format=fmt)

        if self.use_linear_projection:
            hidden_states = as_image(self.proj_out(hidden_states))
        else:
            hidden_states = self.proj_out(as_image(hidden_states))
        return hidden_states + residual


class UnetTransformerBlock(BasicTransformerBlock):
    """``BasicTransformerBlock`` that runs on this rank's slice of the tokens under ``tp_seq``."""

    tp_seq = None
    tp_seq_region = True  # on slices: its norms' and row-parallel biases' gradients summed over TP

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, timestep=None, cross_attention_kwargs=None, class_labels=None,
                added_cond_kwargs=None) -> torch.Tensor:
        if self.tp_seq is None:
            return super().forward(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                   timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
        if attention_mask is not None or encoder_attention_mask is not None or cross_attention_kwargs:
            raise ValueError("a U-Net transformer block on sequence slices takes no attention masks or kwargs")
        return basic_block(self, hidden_states, encoder_hidden_states, self.tp_seq)


def adapt(block: nn.Module) -> nn.Module:
    """``block`` (a U-Net down, mid or up block) with its transformer models and their blocks given
    this module's classes, in place."""
    for m in block.modules():
        if type(m) is Transformer2DModel:
            m.__class__ = UnetTransformer
        elif type(m) is BasicTransformerBlock:
            check_block(m)
            m.__class__ = UnetTransformerBlock
    return block

"""Parts of diffusers' U-Net blocks as this family runs them: transformer models (``Transformer2DModel``
and its ``BasicTransformerBlock``s) with outputs in their input's memory layout and on sequence slices
under tensor parallelism, and ResNets without an NCHW copy of their shortcut input. ``adapt`` gives a
U-Net block's parts these classes in place (subclasses: the same modules, parameters and names; only
methods differ).

**Layout.** On a channels-last network (``models/channels_last.py``, the layout cuDNN runs fastest)
diffusers copies activations to NCHW in two places, each copied back by the convolution after it: a
transformer model turns its token rows back into an image with ``.contiguous()``, and a ResNet with
a shortcut convolution makes its input contiguous in training (a guard against DDP's gradient-stride
warning; DeepSpeed copies gradients into its own buffers). The rows reshaped to [n, h, w, c] and
permuted to NCHW already are a channels-last image, so the transformer's copy is made only where its
input was NCHW, as the library makes it, and the ResNet's is not made. Same values either way.

**Slices.** With a ``tp_seq`` context (``parallel/tp_sequence.py::attach``) each transformer model
keeps this rank's contiguous slice of every image's tokens: its GroupNorm (each group's statistics
summed over the TP ranks' slices), input projection, blocks (``models/diffusers_tp.py::basic_block``:
collectives overlapped with the GEMMs) and output projection run on the slice, which is joined
again for the residual add. The ResNets around it need whole images (convolutions read spatial
neighbours) and split their channels over TP instead (``model.py``'s ``RESNET_PLAN``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn

from disttrain_ds.models.diffusers_tp import basic_block, check_block


def _projected(rows: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """A transformer model's input or output projection on token rows [n, s, C]: a linear, or a
    1 x 1 convolution (SD 1.x), which is the same product per token."""
    if isinstance(proj, nn.Conv2d):
        return F.linear(rows, proj.weight.reshape(proj.out_channels, -1), proj.bias)
    return proj(rows)


class UnetTransformer(Transformer2DModel):
    """``Transformer2DModel`` with its output in its input's layout, and on slices under ``tp_seq``:
    its GroupNorm (statistics of whole images, ``TPSeqContext.group_norm``), projections and
    blocks all on this rank's slice of every image's tokens, joined before the residual add."""

    tp_seq = None
    tp_seq_region = True  # on slices: its norm's and projections' gradients summed over TP

    def _operate_on_continuous_inputs(self, hidden_states: torch.Tensor):
        if self.tp_seq is None:
            return super()._operate_on_continuous_inputs(hidden_states)
        n, c, h, w = hidden_states.shape
        # Token rows (a view of a channels-last image), this rank's slice of them kept.
        part = self.tp_seq.scatter(hidden_states.permute(0, 2, 3, 1).reshape(n, h * w, c))
        part = _projected(self.tp_seq.group_norm(part, self.norm), self.proj_in)
        return part, part.shape[-1]

    def _get_output_for_continuous_inputs(self, hidden_states: torch.Tensor, residual: torch.Tensor, batch_size: int,
                                          height: int, width: int, inner_dim: int) -> torch.Tensor:
        channels_last = residual.is_contiguous(memory_format=torch.channels_last)
        fmt = torch.channels_last if channels_last else torch.contiguous_format

        def as_image(rows: torch.Tensor) -> torch.Tensor:
            channels = rows.shape[-1]
            return rows.reshape(batch_size, height, width, channels).permute(0, 3, 1, 2).contiguous(memory_format=fmt)

        if self.tp_seq is not None:
            hidden_states = as_image(self.tp_seq.gather(_projected(hidden_states, self.proj_out)))
        elif self.use_linear_projection:
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
        check_block(self)  # settings the written-out forward computes (the family's own always are)
        return basic_block(self, hidden_states, encoder_hidden_states, self.tp_seq)


class UnetResnet(ResnetBlock2D):
    """``ResnetBlock2D`` whose shortcut reads its input in the layout it came in (module docstring)."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        plain = (self.upsample is None and self.downsample is None and self.time_embedding_norm == "default"
                 and not self.skip_time_act and self.time_emb_proj is not None and temb is not None)
        if not plain or args or kwargs:  # settings the U-Net blocks here do not use: the library's forward
            return super().forward(input_tensor, temb, *args, **kwargs)
        hidden = self.conv1(self.nonlinearity(self.norm1(input_tensor)))
        temb = self.time_emb_proj(self.nonlinearity(temb))[:, :, None, None]
        hidden = self.conv2(self.dropout(self.nonlinearity(self.norm2(hidden + temb))))
        shortcut = input_tensor if self.conv_shortcut is None else self.conv_shortcut(input_tensor)
        return (shortcut + hidden) / self.output_scale_factor


_CLASSES = {Transformer2DModel: UnetTransformer, BasicTransformerBlock: UnetTransformerBlock, ResnetBlock2D: UnetResnet}


def adapt(block: nn.Module) -> nn.Module:
    """``block`` (a U-Net down, mid or up block) with its transformer models, their blocks and its
    ResNets given this module's classes, in place."""
    for m in block.modules():
        if (cls := _CLASSES.get(type(m))) is not None:
            m.__class__ = cls
    return block

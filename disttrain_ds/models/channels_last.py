"""Channels-last layout for convolutional stages on CUDA.

cuDNN runs convolutions and GroupNorm fastest on NHWC tensors; PyTorch keeps the layout through a
network once the weights and the first input hold it (a convolution with a channels-last weight
returns channels-last). ``to_channels_last`` converts a stage's 4-D weights in place (the values
and parameter names are unchanged, so checkpoints and export are too; the first layer converts its
input, e.g. ``families/unet/model.py::UnetIn``) and lets cuDNN time its kernels for the stage's
shapes (``cudnn.benchmark``: the generator's image size is fixed by its config).
"""

from __future__ import annotations

import torch
from torch import nn


def to_channels_last(module: nn.Module) -> nn.Module:
    """``module`` with every 4-D parameter and buffer in channels-last memory format (in place)."""
    module.to(memory_format=torch.channels_last)
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
    return module

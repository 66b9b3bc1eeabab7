"""The U-Net's blocks keep their activations' memory layout (``families/unet/blocks.py``): on a
channels-last U-Net (what CUDA runs) no activation is copied to NCHW in training, where diffusers'
own transformer models and shortcut ResNets copy theirs; the values are the library model's."""

from __future__ import annotations

import traceback

import torch
from test_compile import _unet_layers  # tests/unit is on sys.path under pytest
from torch.utils._python_dispatch import TorchDispatchMode


class _NchwCopies(TorchDispatchMode):
    """Elements of 4-D activations copied to the default (NCHW) layout, by the file that asked."""

    def __init__(self):
        super().__init__()
        self.by_file: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.clone.default and args[0].dim() == 4 \
                and kwargs.get("memory_format") == torch.contiguous_format:
            caller = next(f.filename for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            name = caller.rsplit("/", 1)[-1]
            self.by_file[name] = self.by_file.get(name, 0) + args[0].numel()
        return func(*args, **kwargs)


def _copies(channels_last: bool) -> tuple[dict[str, int], dict[str, int]]:
    """NCHW copies in one forward and backward of the tiny U-Net's pipeline layers and of the library's
    whole model (the same weights), checking the two agree."""
    layers, ref = _unet_layers(channels_last)
    g = torch.Generator().manual_seed(1)
    x, t, c = torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 1000, (2,), generator=g), \
        torch.randn(2, 4, 32, generator=g)
    with _NchwCopies() as ours:
        h = (c, x, t)
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    with _NchwCopies() as library:
        want = ref(x.contiguous(memory_format=torch.channels_last) if channels_last else x, t,
                   encoder_hidden_states=c).sample
        want.sum().backward()
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-6)
    return ours.by_file, library.by_file


def test_a_channels_last_unet_copies_no_activation_to_nchw():
    ours, library = _copies(channels_last=True)
    assert ours == {}
    # Control: diffusers copies every transformer output (2 images x 16 channels x 16 x 16 px in the
    # tiny U-Net's first down block, and more) and the input of every ResNet with a shortcut convolution.
    assert library["transformer_2d.py"] >= 2 * 16 * 16 * 16 and library["resnet.py"] > 0


def test_an_nchw_unet_copies_as_the_library_does():
    ours, library = _copies(channels_last=False)
    assert ours == {"blocks.py": library["transformer_2d.py"]} and library["transformer_2d.py"] > 0

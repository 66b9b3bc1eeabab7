"""The U-Net's transformer blocks return their output in their input's layout (``families/unet/transformer.py``):
on a channels-last U-Net (what CUDA runs) no activation is copied back to NCHW around them, where
diffusers' own blocks copy each one; the values are the library model's."""

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


def test_a_channels_last_unet_copies_no_transformer_output_back_to_nchw():
    ours, library = _copies(channels_last=True)
    assert "transformer_2d.py" not in ours
    # Control: diffusers' blocks copy every transformer output to NCHW (2 images x 16 x 8 x 8 in the
    # tiny U-Net's first down block, and more).
    assert library["transformer_2d.py"] >= 2 * 16 * 8 * 8


def test_an_nchw_unet_copies_as_the_library_does():
    ours, library = _copies(channels_last=False)
    assert ours.get("transformer.py", 0) == library["transformer_2d.py"] > 0

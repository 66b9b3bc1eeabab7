"""Counting the calls that read a tensor's values on the host (a device sync on CUDA), for tests that
pin a step's hot path as sync-free."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

NAMES = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
"""The ``torch.Tensor`` methods that hand values to the host."""


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """The names of host-reading calls made inside the block, in order (the methods patched on
    ``torch.Tensor`` for its duration, then restored)."""
    calls: list[str] = []
    real = {name: getattr(torch.Tensor, name) for name in NAMES}

    def counting(name: str):
        def call(t, *a, **k):
            calls.append(name)
            return real[name](t, *a, **k)
        return call

    for name in NAMES:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)

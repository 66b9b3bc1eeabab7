"""How a module becomes an ordered list of pipeline layers.

Every module (encoder, LLM, generator) is described by a list of ``LayerDef``: a name and a
zero-argument builder. The same list builds the single-process reference model and, through
DeepSpeed ``LayerSpec``s, the per-stage ``PipelineModule``s, so both start from identical weights:
each builder seeds the RNG from (model seed, module, layer index) before constructing, so a layer's
initial weights do not depend on which rank builds it or in which order.

Layers pass tuples of tensors. Floating tensors in a tuple that crosses a pipeline stage must all
receive a gradient (DeepSpeed sends one per floating tensor), so layers pass through what later
layers need instead of dropping it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class LayerDef:
    """One pipeline layer: a stable name and a builder that returns the seeded nn.Module."""

    name: str
    """Stable, unique name within the module (used for seeding and checkpoint keys)."""
    build: Callable[[], nn.Module]
    """Zero-argument constructor; already seeds the RNG, so calling it twice gives equal weights."""
    frozen: bool = False
    """Keep this layer's weights fixed (no weight gradients, no optimizer state)."""


def layer_seed(seed: int, module: str, name: str) -> int:
    """Deterministic per-layer seed, independent of build order and rank."""
    digest = hashlib.sha256(f"{seed}/{module}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def seeded(seed: int, module: str, name: str, fn: Callable[[], nn.Module]) -> LayerDef:
    """Wrap ``fn`` so it builds under a fork of the RNG seeded for this layer."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, module, name))
            return fn()

    return LayerDef(name, build)


class Sequential(nn.Module):
    """The reference form of a layer list: runs the layers in order on tuples."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, inputs):
        x = inputs
        for layer in self.layers:
            x = layer(x)
        return x


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)

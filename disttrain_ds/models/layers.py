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
    ties: tuple[tuple[str, str], ...] = ()
    """(own parameter, ``leader_layer/parameter``) pairs: parameters that are another layer's
    parameter (tied input and output embeddings). Where both layers sit in one process they are one
    ``nn.Parameter`` (``tie_parameters``); across pipeline stages each stage keeps a copy whose
    gradients are summed before every optimizer step. The builder starts the copy from the leader's
    initial value."""


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


def tied_to(follower: LayerDef, param: str, leader: LayerDef, leader_param: str) -> LayerDef:
    """``follower`` whose parameter ``param`` is ``leader``'s ``leader_param``: it starts from the
    leader's seeded value (so every rank building either layer holds the same number) and carries
    the tie for the places that build both (``tie_parameters``) or one (the pipeline's tied groups)."""

    def build() -> nn.Module:
        layer = follower.build()
        with torch.no_grad():
            layer.get_parameter(param).copy_(leader.build().get_parameter(leader_param))
        return layer

    return LayerDef(follower.name, build, follower.frozen, (*follower.ties, (param, f"{leader.name}/{leader_param}")))


def tied_keys(defs: list[LayerDef]) -> dict[str, str]:
    """``layer/param`` of every tied follower -> ``layer/param`` of its leader."""
    return {f"{d.name}/{own}": lead for d in defs for own, lead in d.ties}


def set_parameter(module: nn.Module, path: str, param: nn.Parameter) -> None:
    """Make ``module``'s parameter at ``path`` (dotted) the object ``param``."""
    owner, _, leaf = path.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


def tie_parameters(built: dict[str, nn.Module], defs: list[LayerDef]) -> list[tuple[str, str, bool]]:
    """Make every follower parameter whose leader layer is also in ``built`` (layer name -> module)
    that very parameter. Returns the ties left open here, as (layer name, parameter, is follower)
    of this side's copy: one of the two layers is built elsewhere (another pipeline stage), so the
    copies' gradients must be summed across the two places."""
    open_ties = []
    for d in defs:
        for own, lead in d.ties:
            layer, param = lead.split("/", 1)
            if d.name in built and layer in built:
                set_parameter(built[d.name], own, built[layer].get_parameter(param))
            elif d.name in built:
                open_ties.append((d.name, own, True))
            elif layer in built:
                open_ties.append((layer, param, False))
    return open_ties


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


class SlicedLayer(nn.Module):
    """A family's forward of ``layer`` on sequence slices, ``forward(layer, *args, **kwargs)``
    (``families/<family>/sharded.py``), as a module of its own: what ``compile_layers`` compiles
    for a block on slices, its collectives left eager between the graphs. It holds the layer
    without registering it, so parameter names, state dicts and hooks stay the layer's own."""

    def __init__(self, layer: nn.Module, forward: Callable[..., torch.Tensor]):
        super().__init__()
        object.__setattr__(self, "layer_", layer)  # not a child module: no second name for its weights
        self.forward_on_slices = forward

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.forward_on_slices(self.layer_, *args, **kwargs)


def stacked_bias(linears: list[nn.Module], like: torch.Tensor) -> torch.Tensor | None:
    """The biases of ``linears`` whose weights are stacked into one GEMM, side by side (zeros for a
    linear without one, in ``like``'s dtype and device); None where none has a bias."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([like.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias for m in linears])

"""Compiled training: each pipeline layer's compute compiled in place.

``compile_layers`` calls ``nn.Module.compile`` on every layer's *compile targets*, so parameter
names, state dicts, checkpoints and export are those of the eager model (``compile`` only sets
the module's call implementation). A layer names its targets with ``compile_targets()``: the
decoder block compiles only its transformers layer (on sequence slices, its written-out forward,
collectives left eager), so what it prepares once per microbatch (positions, rotary tables,
attention arguments: host values read once) stays outside the graph;
layers that loop over items on the host (image and clip embeddings) name none; any other layer is
its own target. Shapes start static and become dynamic where they change (torch's automatic
dynamic shapes: a second shape recompiles once, dynamically, not once per shape). Layers that set
``compile_dynamic = "batch"`` (the U-Net's) take only their inputs' first dimension (images per
microbatch) as dynamic and every other one as static: instances of one layer class share a code
object, so automatic dynamic shapes would make their spatial sizes symbolic too (the down blocks
run at several resolutions), and inductor in torch 2.13 cannot lower the convolutions then
("cannot determine truth value of Relational"); static per image count instead would recompile
for every count, up to torch's 8 graphs per code object, then run eager. ``graphs_compiled``
counts every graph made, so a run reports recompiles as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch._dynamo.utils import counters

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.tensor_tree import tensors_in


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """``train.compile`` on ``device``: auto is on CUDA only."""
    if setting == "auto":
        return device.type == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ConfigError(f"train.compile must be true, false or auto, got {setting!r}")


def compile_targets(layer: nn.Module) -> list[nn.Module]:
    """The submodules of ``layer`` to compile (its ``compile_targets()``, else the layer itself)."""
    pick = getattr(layer, "compile_targets", None)
    return list(pick()) if pick is not None else [layer]


def compile_layers(layers: Iterable[nn.Module], backend: str | Callable = "inductor") -> int:
    """Compile every layer's targets in place (module docstring); the number of modules compiled.
    ``backend``: torch.compile's (tests count graphs with a counting one)."""
    n = 0
    for layer in layers:
        dynamic = getattr(layer, "compile_dynamic", None)
        for target in compile_targets(layer):
            if dynamic == "batch":
                # What ``nn.Module.compile`` sets, with the inputs' dimensions marked on each call.
                target._compiled_call_impl = _batch_dynamic(torch.compile(target._call_impl, backend=backend))
            else:
                target.compile(dynamic=dynamic, backend=backend)
            n += 1
    return n


def _batch_dynamic(compiled: Callable) -> Callable:
    """``compiled`` called with every input tensor's first dimension dynamic (size 1 still gets its
    own graph: torch specialises it) and every other dimension static."""

    def call(*args, **kwargs):
        for t in tensors_in((args, kwargs)):
            if t.dim():
                torch._dynamo.maybe_mark_dynamic(t, 0)
                for d in range(1, t.dim()):
                    torch._dynamo.mark_static(t, d)
        return compiled(*args, **kwargs)

    return call


def graphs_compiled() -> int:
    """Graphs torch.compile has made in this process so far (first compiles and recompiles)."""
    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks torch.compile has met in this process so far."""
    return int(sum(counters["graph_break"].values()))

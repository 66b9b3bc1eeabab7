"""Bytes autograd keeps for backward while a layer runs, counted with saved-tensor hooks (the
memory estimate's tests compare its formulas with these)."""

from __future__ import annotations

import torch


def saved_bytes(layer: torch.nn.Module, fn) -> tuple[int, object]:
    """Bytes autograd keeps in ``fn()``, parameters excluded, each storage once; and ``fn()``."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out

"""Projectors between modules: two-layer MLPs (Linear, GELU, Linear), as in LLaVA-style MLLMs."""

from __future__ import annotations

from torch import nn


class MLPProjector(nn.Sequential):
    """Maps one module's width to the next module's width."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int | None = None):
        hidden = hidden or out_dim
        super().__init__(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

"""Projectors between modules: two-layer MLPs (Linear, GELU, Linear), as in LLaVA-style MLLMs.

A projector is its own pipeline layer with its own frozen flag, so a recipe can train only the
projectors (LLaVA's first stage) or freeze them while the encoder trains.
"""

from __future__ import annotations

from torch import nn


class MLPProjector(nn.Sequential):
    """Maps one module's width to the next module's width."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int | None = None):
        hidden = hidden or out_dim
        super().__init__(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))


class InputProjector(nn.Module):
    """Encoder side, last layer: encoder features [rows, width] -> LLM embeddings [rows, llm width]."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.projector = MLPProjector(in_dim, out_dim)

    def forward(self, inputs):
        return self.projector(inputs[0] if isinstance(inputs, tuple) else inputs)


class ConditionProjector(nn.Module):
    """Generator side, first layer: (LLM states [n, K, H], noisy, timesteps) -> (cond [n, K, width], noisy, timesteps)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = MLPProjector(in_dim, out_dim)

    def forward(self, inputs):
        states, noisy, timesteps = inputs
        return self.proj(states), noisy, timesteps

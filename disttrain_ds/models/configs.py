"""Config parts every family shares: the projector's section, and whether a module trains.

Each family's own config dataclass and presets live in its folder (``families/<name>/config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProjectorConfig:
    """The MLP that maps between an encoder or generator and the LLM (its own pipeline layer)."""

    frozen: bool = False
    """Keep the projector's weights fixed (independently of its module's ``frozen``)."""


def trains(cfg) -> bool:
    """Whether any weight of a module trains: its own layers, or its projector."""
    projector = getattr(cfg, "projector", None)
    return not cfg.frozen or (projector is not None and not projector.frozen)

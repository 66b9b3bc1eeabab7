"""The module graph: named modules with roles, and the edges a sample's tensors travel along.

A multimodal LLM here is a star: any number of encoders feed the one LLM, and the LLM feeds any
number of generators (encoders -> LLM -> generators). Understanding-only models have no
generator, generation-only models no encoder. Every part of the system that used to name
"encoder", "llm" and "generator" asks the graph instead: which modules exist, in which order,
who feeds whom, and how the one 1F1B pipeline lays their stages end to end.

Pure data, no torch: the planner, the simulator and the runtime share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

from disttrain_ds.errors import ConfigError

ROLES = ("encoder", "llm", "generator")
"""Roles in data-flow order."""

MODULE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""A module name: it becomes a recipe key, a metrics key and a checkpoint folder."""

DEFAULT_ROLES: dict[str, str] = {"encoder": "encoder", "llm": "llm", "generator": "generator"}
"""The three-module graph every recipe without a graph section describes."""
MODULES: tuple[str, ...] = tuple(DEFAULT_ROLES)
"""The three-module graph's module names (each named after its role)."""


@dataclass(frozen=True)
class GraphNode:
    """One module of the graph."""

    name: str
    """Unique module name (recipe key, metrics key, checkpoint folder)."""
    role: str
    """encoder | llm | generator."""


@dataclass(frozen=True)
class ModuleGraph:
    """Modules in data-flow order (encoders, then the LLM, then generators) and their edges."""

    nodes: tuple[GraphNode, ...]
    """Every module, encoders first, then the LLM, then generators, each group in recipe order."""

    @staticmethod
    def from_roles(roles: Mapping[str, str], src: str = "<recipe>", key: str = "model.modules") -> "ModuleGraph":
        """The graph of ``{name: role}``; one-line ConfigError naming ``key`` when it is not a star."""
        for name, role in roles.items():
            if not isinstance(name, str) or MODULE_NAME.fullmatch(name) is None:
                raise ConfigError(f"{src}: '{key}' module name {name!r} must be lower-case letters, digits and "
                                  "'_', starting with a letter, at most 32 characters")
            if role not in ROLES:
                raise ConfigError(f"{src}: '{key}.{name}.role' must be one of {' | '.join(ROLES)}, got {role!r}")
        llms = [n for n, r in roles.items() if r == "llm"]
        if len(llms) != 1:
            raise ConfigError(f"{src}: '{key}' needs exactly one module with role llm, got {len(llms)}"
                              + (f" ({', '.join(llms)})" if llms else ""))
        if len(roles) < 2:
            raise ConfigError(f"{src}: '{key}' needs at least one encoder or generator beside the llm")
        ordered = [GraphNode(n, r) for role in ROLES for n, r in roles.items() if r == role]
        return ModuleGraph(tuple(ordered))

    @staticmethod
    def default() -> "ModuleGraph":
        return ModuleGraph.from_roles(DEFAULT_ROLES)

    # Roles and names are read in the planner's inner loops: computed once (the graph is frozen).
    @cached_property
    def names(self) -> tuple[str, ...]:
        """Module names in data-flow order."""
        return tuple(n.name for n in self.nodes)

    def role(self, name: str) -> str:
        for n in self.nodes:
            if n.name == name:
                return n.role
        raise KeyError(name)

    def of_role(self, role: str) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.role == role)

    @cached_property
    def encoders(self) -> tuple[str, ...]:
        return self.of_role("encoder")

    @cached_property
    def llm(self) -> str:
        return self.of_role("llm")[0]

    @cached_property
    def generators(self) -> tuple[str, ...]:
        return self.of_role("generator")

    @cached_property
    def edges(self) -> tuple[tuple[str, str], ...]:
        """(upstream, downstream) pairs: every encoder -> the LLM, the LLM -> every generator."""
        return tuple((e, self.llm) for e in self.encoders) + tuple((self.llm, g) for g in self.generators)

    def upstream(self, name: str) -> tuple[str, ...]:
        return tuple(a for a, b in self.edges if b == name)

    def downstream(self, name: str) -> tuple[str, ...]:
        return tuple(b for a, b in self.edges if a == name)

    def runs_backward(self, trains: Mapping[str, bool]) -> dict[str, bool]:
        """Which modules run backward passes: those that train (``trains``) or have a module
        upstream that does (gradients must pass through them); two encoders never affect each other."""
        out: dict[str, bool] = {}
        for n in self.names:  # data-flow order: upstream modules come first
            out[n] = bool(trains[n]) or any(out[u] for u in self.upstream(n))
        return out

    def critical_path(self, weights: Mapping[str, float]) -> float:
        """Largest sum of ``weights`` along any encoder -> LLM -> generator path.

        Written as (w_llm + (max_enc + max_gen)), the float order of the three-module formula
        ``w_llm + (w_enc + w_gen)``, so a three-module graph gives that sum bit for bit."""
        enc = max((weights[n] for n in self.encoders), default=0.0)
        gen = max((weights[n] for n in self.generators), default=0.0)
        return weights[self.llm] + (enc + gen)

    def stage_offsets(self, pp: Mapping[str, int]) -> tuple[dict[str, int], int]:
        """Each module's first global pipeline stage, and the number of global stages.

        One 1F1B pipeline runs over the longest path: every encoder's last stage sits right
        before the LLM's first, every generator's first stage right after the LLM's last; a
        module on a shorter path simply starts later (encoders) or ends earlier (generators)."""
        enc = max((pp[n] for n in self.encoders), default=0)
        gen = max((pp[n] for n in self.generators), default=0)
        llm_first = enc
        offsets = {n: llm_first - pp[n] for n in self.encoders}
        offsets[self.llm] = llm_first
        offsets.update({n: llm_first + pp[self.llm] for n in self.generators})
        return offsets, enc + pp[self.llm] + gen

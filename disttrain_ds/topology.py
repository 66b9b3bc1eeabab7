"""Rank map of a job: which global ranks each module owns, and its DP x PP x TP grid there.

Pure data, no process groups. Modules take disjoint, contiguous rank ranges in the module
graph's data-flow order (encoders -> LLM -> generators). Inside a module, ranks are laid out like DeepSpeed's
``PipeModelDataParallelTopology`` (axes pipe, data, model), offset by the module's first rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain_ds.errors import ConfigError
from disttrain_ds.graph import ModuleGraph


@dataclass(frozen=True)
class ModuleGrid:
    """One module's ranks and degrees.

    With sequence parallelism the SP ranks of a replica sit inside DeepSpeed's data axis (which has
    DP x SP coordinates, replica-major): they hold the same samples, each a slice of every sequence.
    ``dp`` counts replicas; a rank's data-axis coordinate is ``data_coords``'."""

    name: str
    """The module's name in the graph."""
    first_rank: int
    """Global rank of the module's (pipe 0, data 0, model 0) coordinate."""
    dp: int
    """Data-parallel replicas."""
    pp: int
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel degree."""
    sp: int = 1
    """Sequence-parallel degree: ranks per replica that split every sequence (Ulysses)."""
    sp_auto: bool = False
    """Adaptive SP (``parallel.<module>.sp: auto``): the ``dp`` ranks form SP groups per microbatch."""

    @property
    def size(self) -> int:
        return self.dp * self.sp * self.pp * self.tp

    @property
    def data_size(self) -> int:
        """Coordinates of DeepSpeed's data axis: DP x SP."""
        return self.dp * self.sp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    def rank(self, *, stage: int, dp: int, tp: int = 0, sp: int = 0) -> int:
        """Global rank at (pipe stage, data replica, tensor slice, sequence slice)."""
        if not (0 <= stage < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp and 0 <= sp < self.sp):
            raise ValueError(f"{self.name}: coordinate (stage={stage}, dp={dp}, tp={tp}, sp={sp}) out of range")
        return self.first_rank + (stage * self.data_size + dp * self.sp + sp) * self.tp + tp

    def data_coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, data-axis index, tp) of a global rank owned by this module: DeepSpeed's coordinates."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in module {self.name} ({self.ranks.start}..{self.ranks.stop - 1})")
        local = rank - self.first_rank
        tp = local % self.tp
        data = (local // self.tp) % self.data_size
        return local // (self.tp * self.data_size), data, tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, dp replica, tp) of a global rank owned by this module."""
        stage, data, tp = self.data_coords(rank)
        return stage, data // self.sp, tp

    def sp_index(self, rank: int) -> int:
        """Which slice of every sequence ``rank`` holds (0 without SP: the rank that talks across boundaries)."""
        return self.data_coords(rank)[1] % self.sp

    def dp_group(self, *, stage: int, tp: int = 0) -> list[int]:
        return [self.rank(stage=stage, dp=d, tp=tp) for d in range(self.dp)]

    def pp_group(self, *, dp: int, tp: int = 0) -> list[int]:
        return [self.rank(stage=s, dp=dp, tp=tp) for s in range(self.pp)]

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group's global ranks (TP consecutive ranks each)."""
        return [[self.rank(stage=s, dp=d, tp=t, sp=q) for t in range(self.tp)]
                for s in range(self.pp) for d in range(self.dp) for q in range(self.sp)]

    def adaptive_groups(self) -> list[tuple[tuple[int, int], list[int]]]:
        """With ``sp_auto``: every aligned group of 2 or more of the ``dp`` ranks of each stage and TP
        index, as ((first data index, size), global ranks), sizes ascending; empty without it."""
        if not self.sp_auto:
            return []
        out = []
        size = 2
        while size <= self.dp:
            for s in range(self.pp):
                for t in range(self.tp):
                    for first in range(0, self.dp, size):
                        out.append(((first, size), [self.rank(stage=s, dp=d, tp=t) for d in range(first, first + size)]))
            size *= 2
        return out

    def sp_groups(self) -> list[list[int]]:
        """Every sequence-parallel group's global ranks (one per stage, replica and TP index)."""
        return [[self.rank(stage=s, dp=d, tp=t, sp=q) for q in range(self.sp)]
                for s in range(self.pp) for d in range(self.dp) for t in range(self.tp)]


@dataclass(frozen=True)
class Topology:
    """All modules of a job, in data-flow order."""

    modules: tuple[ModuleGrid, ...]
    """Module grids in data-flow order."""
    layout: str
    """monolithic | disaggregated (the reference layout has no topology)."""
    roles: tuple[str, ...] = ()
    """Each module's role (encoder | llm | generator), aligned with ``modules``; empty: a chain
    (every module feeds the next)."""

    @property
    def graph(self) -> ModuleGraph | None:
        """The module graph, or None for a chain."""
        if not self.roles:
            return None
        return ModuleGraph.from_roles({m.name: r for m, r in zip(self.modules, self.roles)})

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        """(upstream, downstream) module names of every boundary."""
        graph = self.graph
        if graph is None:
            return tuple((a.name, b.name) for a, b in zip(self.modules, self.modules[1:]))
        return graph.edges

    def _offsets(self) -> tuple[dict[str, int], int]:
        graph = self.graph
        if graph is None:
            offsets, off = {}, 0
            for m in self.modules:
                offsets[m.name], off = off, off + m.pp
            return offsets, off
        return graph.stage_offsets({m.name: m.pp for m in self.modules})

    @property
    def world_size(self) -> int:
        return sum(m.size for m in self.modules)

    def module(self, name: str) -> ModuleGrid:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    def module_of(self, rank: int) -> ModuleGrid:
        for m in self.modules:
            if rank in m.ranks:
                return m
        raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    @property
    def total_stages(self) -> int:
        """Stages of the one 1F1B pipeline laid end to end along the graph's longest path."""
        return self._offsets()[1]

    def stage_offset(self, name: str) -> int:
        """Global pipeline index of a module's first stage (``ModuleGraph.stage_offsets``)."""
        return self._offsets()[0][name]

    def upstreams(self, name: str) -> tuple[ModuleGrid, ...]:
        """The grids of the modules feeding ``name``, in data-flow order."""
        return tuple(self.module(a) for a, b in self.edges if b == name)

    def downstreams(self, name: str) -> tuple[ModuleGrid, ...]:
        """The grids of the modules ``name`` feeds, in data-flow order."""
        return tuple(self.module(b) for a, b in self.edges if a == name)

    def neighbours(self, name: str) -> tuple[ModuleGrid | None, ModuleGrid | None]:
        """The one module upstream and the one downstream of ``name`` (None where there is none)."""
        ups, downs = self.upstreams(name), self.downstreams(name)
        if len(ups) > 1 or len(downs) > 1:
            raise ValueError(f"module {name} has several upstream or downstream modules")
        return (ups[0] if ups else None), (downs[0] if downs else None)

    @staticmethod
    def build(graph: ModuleGraph, degrees: dict[str, tuple[int, ...]], layout: str) -> "Topology":
        """The modules of ``graph`` on consecutive rank ranges in data-flow order, each with its
        ``(dp, pp, tp)`` or ``(dp, pp, tp, sp)`` from ``degrees`` (a recipe's: ``recipe/graph.py::topology_of``)."""
        grids, first = [], 0
        for name in graph.names:
            g = ModuleGrid(name, first, *degrees[name])
            grids.append(g)
            first += g.size
        return Topology(tuple(grids), layout, tuple(graph.role(n) for n in graph.names))

    def check_world(self, world_size: int, src: str = "<recipe>") -> None:
        if world_size != self.world_size:
            raise ConfigError(
                f"{src}: 'parallel': layout '{self.layout}' needs {self.world_size} ranks "
                f"({' + '.join(f'{m.name} {m.size}' for m in self.modules)}) but the job has {world_size}"
            )

    def describe(self) -> str:
        """Human-readable rank map, printed at start-up."""
        lines = [f"layout {self.layout}: {self.world_size} ranks, {self.total_stages} pipeline stages"]
        for m in self.modules:
            lines.append(
                f"  {m.name:<9} ranks {m.ranks.start:>3}-{m.ranks.stop - 1:<3} dp={m.dp} pp={m.pp} tp={m.tp}"
                + (f" sp={m.sp}" if m.sp > 1 else " sp=auto" if m.sp_auto else "") +
                f"  stages {self.stage_offset(m.name)}-{self.stage_offset(m.name) + m.pp - 1}"
            )
        return "\n".join(lines)

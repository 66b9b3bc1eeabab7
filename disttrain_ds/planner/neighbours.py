"""The search's feasibility rules for single layouts, for the local searches around its finalists
(``refine.py``'s estimate-ranked beam, ``climb.py``'s simulated descent)."""

from __future__ import annotations

from collections.abc import Mapping

from disttrain_ds.cost.profile import Profile
from disttrain_ds.planner.objective import Degrees
from disttrain_ds.planner.placement import alignment, tp_aligned
from disttrain_ds.planner.search import down_key, options
from disttrain_ds.planner.units import Opts

Layout = dict[str, Degrees]


def degrees_of(o: Opts) -> list[Degrees]:
    """Every option of ``o`` as the planner's degrees."""
    return list(map(Degrees._make, zip(o.dp.tolist(), o.tp.tolist(), o.pp.tolist(), o.sp.tolist())))


def _down(profile: Profile, layout: Mapping[str, Degrees]) -> tuple[int, int] | None:
    """The layout's (LLM PP, longest generator's PP) (``search.downstream_splits``); None without
    a memory limit (options do not depend on it)."""
    if profile.memory_limit_bytes is None:
        return None
    graph = profile.graph
    return layout[graph.llm].pp, max((layout[g].pp for g in graph.generators), default=0)


class Feasible:
    """Whether a layout obeys the search's rules (``search.options`` per module for the layout's
    pipeline depths, the GPU budget, the node rule), with each module's options listed once."""

    def __init__(self, profile: Profile, memo: dict, caps: Mapping[str, int], aligned: bool) -> None:
        """``memo``: ``search.options``' memo of this profile; ``caps``: each module's most GPUs;
        ``aligned``: the node rule (no TP group across nodes)."""
        self.profile, self.memo, self.caps = profile, memo, caps
        self.align = alignment(profile) if aligned else 1
        self._sets: dict[tuple, frozenset[Degrees]] = {}

    def options(self, name: str, d: int, down: tuple[int, int] | None = None) -> Opts:
        """Module ``name``'s options at D = ``d`` samples per step (``down``: for those pipeline
        depths downstream; None: the fewest microbatches in flight, so every candidate)."""
        p = self.profile
        return options(p, name, d, self.caps[name], p.memory_limit_bytes, align=self.align, down=down,
                       memo=self.memo)

    def allowed(self, name: str, d: int, down: tuple[int, int] | None) -> frozenset[tuple[int, int, int, int]]:
        key = (name, d, None if down is None else down_key(self.profile.graph, name, down))
        if key not in self._sets:
            o = self.options(name, d, down)  # plain tuples: equal to, and hashed as, the Degrees they list
            self._sets[key] = frozenset(zip(o.dp.tolist(), o.tp.tolist(), o.pp.tolist(), o.sp.tolist()))
        return self._sets[key]

    def __call__(self, layout: Mapping[str, Degrees]) -> bool:
        p, graph = self.profile, self.profile.graph
        if sum(x.gpus for x in layout.values()) > p.gpus or (self.align > 1 and not tp_aligned(layout, graph.names)):
            return False
        d, down = layout[graph.llm].dp * p.microbatch, _down(p, layout)
        return all(layout[n] in self.allowed(n, d, down) for n in graph.names)

"""Descent on the simulated iteration from the fastest simulated layout.

The finalists (closed forms) and the refined layouts (``refine.py``'s step estimate) are ranked by
models of a step that miss how a 1F1B iteration really couples modules: a replica waits only for the
partners it exchanges samples with, and a stage runs at most as many microbatches ahead as the
pipeline is deep, so the depth of one module changes how much another one's stragglers cost. The
simulation (``iteration_sim``) has both; :func:`climb` follows it directly:

from the fastest simulated layout, every layout that changes one module's degrees at the same
samples per step, and the LLM's at any other split of the global batch with the other modules
kept (the search's options, memory, GPU budget, caps and node rule: ``neighbours``), is simulated
on the planner's batches, and the descent moves to the fastest one while it is faster, at most
``ROUNDS`` times. The cost stays low: neighbours that differ only in TP degrees (the same DP and
PP shape, so the same replica DAG) share one sweep (``iteration_sim.simulate_scaled``, every
batch at once), shapes are simulated in order of their neighbours' lower bounds (``sim_bound``),
and none whose bounds reach the current time or the fastest neighbour found is simulated.

The result is a local minimum of the simulated time over one-module changes, not the global
minimum; ``bench/bench_hetero_plan.py`` measures how far that is from the best of every layout.
Layouts with adaptive SP groups are not climbed from or to (the sweep does not regroup replicas).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from disttrain_ds.cost.profile import AUTO_SP, Profile
from disttrain_ds.planner.iteration_sim import simulate_scaled
from disttrain_ds.planner.neighbours import Feasible, Layout, degrees_of
from disttrain_ds.planner.objective import Degrees
from disttrain_ds.planner.plan import Plan
from disttrain_ds.planner.search import batch_splits
from disttrain_ds.planner.sim_bound import SimBound

ROUNDS = 4
"""Most moves of the descent."""


def layout_bound(profile: Profile, bound: SimBound, layout: Mapping[str, Degrees]) -> float:
    """``bound``'s lower bound on ``layout``'s simulated time (0 with adaptive SP groups, which
    it does not cover)."""
    if any(x.sp == AUTO_SP for x in layout.values()):
        return 0.0
    d = layout[profile.graph.llm].dp * profile.microbatch
    terms = {n: bound.terms(n, profile.modules[n].cost(x.tp, x.sp), x.dp, x.pp, d // x.dp)
             for n, x in layout.items()}
    return float(bound.bound(*({n: t[i] for n, t in terms.items()} for i in range(3))))


def _shape(layout: Mapping[str, Degrees], names: tuple[str, ...]) -> tuple:
    return tuple((layout[n].dp, layout[n].pp) for n in names)


class SimulatedTimes:
    """Mean simulated iteration (ms) of layouts on fixed batches, in loader order: every layout of
    one DP and PP shape in one sweep."""

    def __init__(self, profile: Profile, unit: np.ndarray, build: Callable[[Layout], Plan]) -> None:
        """``unit``: ``[batches, global_batch, modules]`` unit times (``optimize.sim_unit_times``);
        ``build``: a layout's plan (only its graph and degrees are read)."""
        self.profile, self.unit, self.build = profile, unit, build

    def __call__(self, layouts: list[Layout]) -> np.ndarray:
        """``[len(layouts)]`` mean simulated times; every layout of one shape."""
        names = self.profile.graph.names
        scales = np.array([[self.profile.modules[n].cost(x[n].tp, x[n].sp) for n in names] for x in layouts])
        return simulate_scaled(self.unit, self.build(layouts[0]), scales).mean(axis=1)


def climb(profile: Profile, start: Layout, unit: np.ndarray, feasible: Feasible,
          build: Callable[[Layout], Plan], rounds: int | None = None) -> tuple[Layout, float]:
    """The descent's last layout and its mean simulated time on ``unit`` (module docstring), from
    ``start`` (without adaptive SP groups); ``feasible``: the search's rules with its caps and node
    rule; ``build``: a layout's plan (``optimize.build_plan`` without the schedule's prediction);
    ``rounds``: most moves (default ``ROUNDS``)."""
    if any(x.sp == AUTO_SP for x in start.values()):
        raise ValueError("the descent cannot start from adaptive SP groups (the sweep does not regroup replicas)")
    names, graph = profile.graph.names, profile.graph
    times = SimulatedTimes(profile, unit, build)
    current, best = dict(start), float(times([dict(start)])[0])
    bound = SimBound(graph, unit, ordered=True)
    columns: dict[tuple[str, int], tuple[list[Degrees], tuple[np.ndarray, ...]]] = {}

    def column(n: str, d: int) -> tuple[list[Degrees], tuple[np.ndarray, ...]]:
        """Module n's options at D = d and each one's (own, up_f, up_b) bound terms."""
        if (n, d) not in columns:
            xs = [x for x in degrees_of(feasible.options(n, d)) if x.sp != AUTO_SP]
            v = np.array([(profile.modules[n].cost(o.tp, o.sp), o.dp, o.pp, d // o.dp) for o in xs]).reshape(-1, 4)
            columns[(n, d)] = xs, bound.terms(n, v[:, 0], *(v[:, i].astype(int) for i in (1, 2, 3)))
        return columns[(n, d)]

    for _ in range(ROUNDS if rounds is None else rounds):
        d = current[graph.llm].dp * profile.microbatch
        cols = {n: column(n, d) for n in names}
        if any(current[n] not in cols[n][0] for n in names):  # e.g. caps below the start's degrees
            break
        at = {n: cols[n][0].index(current[n]) for n in names}
        shapes: dict[tuple, tuple[list[float], list[Layout]]] = {}

        def consider(layout: Layout, lb: float) -> None:
            if lb < best and feasible(layout):
                lbs, same = shapes.setdefault(_shape(layout, names), ([], []))
                lbs.append(lb)
                same.append(layout)

        for n in names:  # one module's degrees at the same D: the bound from the terms at hand
            xs, terms = cols[n]
            parts = [{m: terms[i] if m == n else cols[m][1][i][at[m]] for m in names} for i in range(3)]
            for x, lb in zip(xs, bound.bound(*parts)):
                if x != current[n]:
                    consider({**current, n: x}, float(lb))
        rest = [current[n].dp for n in names if n != graph.llm]
        for other in batch_splits(profile):  # the LLM's degrees at another D, the rest kept
            if other != d and all(other % dp == 0 for dp in rest):  # the others' DPs divide the new D
                for x in column(graph.llm, other)[0]:
                    layout = {**current, graph.llm: x}
                    if feasible(layout):  # (memory at the new D, GPU budget, node rule)
                        consider(layout, layout_bound(profile, bound, layout))
        # Shapes in order of their lowest bound; once that reaches the fastest neighbour found,
        # no later shape holds a faster one (ties: the earlier shape, then the earlier layout).
        found: tuple[float, int, Layout] | None = None
        order = sorted(enumerate(shapes.values()), key=lambda x: (min(x[1][0]), x[0]))
        for k, (lbs, same) in order:
            if found is not None and min(lbs) >= found[0]:
                break
            t = times(same)
            i = int(np.argmin(t))
            if found is None or (float(t[i]), k) < found[:2]:
                found = (float(t[i]), k, same[i])
        if found is None or not found[0] < best * (1 - 1e-12):
            break
        best, current = found[0], found[2]
    return current, best

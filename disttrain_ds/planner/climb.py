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
``ROUNDS`` times. Where no neighbour is faster it does not stop at once: modules are coupled, so
the way to a faster layout often leads through slower ones (a deeper generator pipeline first,
which only pays once the LLM runs at more DP). It steps to the fastest neighbour not yet visited,
up to ``ESCAPES`` times in a row, and goes on descending if a layout faster than the minimum turns
up. Last, from the minimum, every module but the LLM takes one DP degree together on the GPUs it
has (``realigned``): equal DPs pair replicas one to one, and no one-module move gets there from
unequal ones without slower layouts between. If one of those is faster the descent goes on from
it, otherwise it returns the minimum. The cost stays low: neighbours that differ only in TP degrees
(the same DP and PP shape, so the same replica DAG) share one sweep
(``iteration_sim.simulate_scaled``, every batch at once), shapes are simulated in order of their
neighbours' lower bounds (``sim_bound``), none whose bounds reach the best time or the fastest
neighbour found is simulated, and no layout is simulated twice.

The result is a local minimum of the simulated time over one-module changes and realignments that
two slower steps do not lead out of, not the global minimum; ``bench/bench_hetero_plan.py``
measures how far that is from the best of every layout.
Layouts with adaptive SP groups are not climbed from or to (the sweep does not regroup replicas).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from disttrain_ds.cost.profile import AUTO_SP, TP_DEGREES, Profile
from disttrain_ds.planner.iteration_sim import simulate_scaled
from disttrain_ds.planner.neighbours import Feasible, Layout, degrees_of
from disttrain_ds.planner.objective import Degrees
from disttrain_ds.planner.plan import Plan
from disttrain_ds.planner.search import batch_splits
from disttrain_ds.planner.sim_bound import SimBound

ROUNDS = 4
"""Most moves of the descent to a faster layout."""
ESCAPES = 2
"""Steps in a row the descent may take from a local minimum to the fastest unvisited neighbour
(slower than the minimum) before it stops there; a faster layout found on the way resets them."""


def module_terms(profile: Profile, bound: SimBound, n: str, x: Degrees, d: int) -> tuple:
    """``bound``'s (own, up_f, up_b) terms of module ``n`` at degrees ``x`` and D = ``d`` samples per step."""
    return bound.terms(n, profile.modules[n].cost(x.tp, x.sp), x.dp, x.pp, d // x.dp)


def layout_bound(profile: Profile, bound: SimBound, layout: Mapping[str, Degrees]) -> float:
    """``bound``'s lower bound on ``layout``'s simulated time (0 with adaptive SP groups, which
    it does not cover)."""
    if any(x.sp == AUTO_SP for x in layout.values()):
        return 0.0
    d = layout[profile.graph.llm].dp * profile.microbatch
    terms = {n: module_terms(profile, bound, n, x, d) for n, x in layout.items()}
    return float(bound.bound(*({n: t[i] for n, t in terms.items()} for i in range(3))))


def realigned(layout: Layout, llm: str, d: int) -> list[Layout]:
    """Layouts where every module but the LLM takes one other DP degree dividing ``d`` (samples per
    step) on the GPUs and pipeline depth it has, TP making up the difference; only those that change
    two modules or more (one-module changes are neighbours already). A replica exchanges samples
    only with its partners, so equal DPs across modules pair replicas one to one, which no
    one-module move reaches from unequal ones without passing through slower layouts."""
    others = [n for n in layout if n != llm]
    out = []
    for dp in (k for k in range(1, d + 1) if d % k == 0):
        moved = {}
        for n in others:
            x = layout[n]
            if x.sp != 1 or (x.dp * x.tp) % dp or (x.dp * x.tp) // dp not in TP_DEGREES:
                break
            moved[n] = x._replace(dp=dp, tp=x.dp * x.tp // dp)
        else:
            if sum(moved[n] != layout[n] for n in others) >= 2:
                out.append({**layout, **moved})
    return out


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
    ``rounds``: most moves to a faster layout (default ``ROUNDS``; 0: none, no escape either)."""
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

    key = lambda x: tuple(x[n] for n in names)  # noqa: E731
    known = {key(current): best}  # simulated times (the same batches every round)
    visited, realigned_at = {key(current)}, set()

    def fastest(candidates: list[tuple[Layout, float]]) -> tuple[float, Layout] | None:
        """The fastest simulated of unvisited, feasible ``candidates`` (layout, lower bound) whose
        bound is below the best time: shapes in order of their lowest bound, and once that reaches
        the fastest found no later shape holds a faster one (ties: the earlier shape and layout)."""
        shapes: dict[tuple, tuple[list[float], list[Layout]]] = {}
        found: tuple[float, int, Layout] | None = None
        for layout, lb in candidates:
            k = key(layout)
            if lb >= best or k in visited or not feasible(layout):
                continue
            if k in known:  # simulated in an earlier round
                if found is None or known[k] < found[0]:
                    found = (known[k], -1, layout)
                continue
            lbs, same = shapes.setdefault(_shape(layout, names), ([], []))
            lbs.append(lb)
            same.append(layout)
        for i, (lbs, same) in sorted(enumerate(shapes.values()), key=lambda x: (min(x[1][0]), x[0])):
            if found is not None and min(lbs) >= found[0]:
                break
            t = times(same)
            known.update(zip(map(key, same), map(float, t)))
            j = int(np.argmin(t))
            if found is None or (float(t[j]), i) < found[:2]:
                found = (float(t[j]), i, same[j])
        return None if found is None else (found[0], found[2])

    moves, escapes, here = 0, ESCAPES, current
    limit = ROUNDS if rounds is None else rounds
    while moves < limit:
        d = here[graph.llm].dp * profile.microbatch
        cols = {n: column(n, d) for n in names}
        if any(here[n] not in cols[n][0] for n in names):  # e.g. caps below the start's degrees
            break
        at = {n: cols[n][0].index(here[n]) for n in names}
        candidates = []
        for n in names:  # one module's degrees at the same D: the bound from the terms at hand
            xs, terms = cols[n]
            parts = [{m: terms[i] if m == n else cols[m][1][i][at[m]] for m in names} for i in range(3)]
            candidates += [({**here, n: x}, float(lb)) for x, lb in zip(xs, bound.bound(*parts)) if x != here[n]]
        rest = [here[n].dp for n in names if n != graph.llm]
        for other in batch_splits(profile):  # the LLM's degrees at another D, the rest kept
            if other != d and all(other % dp == 0 for dp in rest):  # the others' DPs divide the new D
                xs, terms = column(graph.llm, other)  # (``fastest`` checks memory at the new D, GPUs, nodes)
                kept = {m: module_terms(profile, bound, m, here[m], other) for m in names if m != graph.llm}
                parts = [{m: terms[i] if m == graph.llm else kept[m][i] for m in names} for i in range(3)]
                candidates += [({**here, graph.llm: x}, float(lb)) for x, lb in zip(xs, bound.bound(*parts))]
        found = fastest(candidates)
        if found is not None and found[0] < best * (1 - 1e-12):
            best, current, moves, escapes = found[0], found[1], moves + 1, ESCAPES
        elif found is not None and escapes > 0:  # a local minimum: step to its fastest neighbour, look there
            escapes -= 1
        elif key(current) not in realigned_at:  # last, the minimum's DPs realigned across modules
            realigned_at.add(key(current))
            found = fastest([(x, layout_bound(profile, bound, x))  # (feasible first: TP degrees the profile prices)
                             for x in realigned(current, graph.llm, current[graph.llm].dp * profile.microbatch)
                             if feasible(x)])
            if found is None or not found[0] < best * (1 - 1e-12):
                break
            best, current, moves, escapes = found[0], found[1], moves + 1, ESCAPES
        else:
            break
        here = found[1]
        visited.add(key(here))
    return current, best

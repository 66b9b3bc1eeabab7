"""Layouts near the finalists, ranked by what a sampled step waits for.

The closed form (``objective.py``) prices each module by its *expected* stage time and takes
the max over modules; a 1F1B step waits for the slowest stage of *that* step. On long-tailed
draws the two rank layouts differently, and the fastest simulated layout is often one that
neither closed-form ranking puts first (a neighbour of a finalist: the same samples per step,
one module with other degrees). This module finds such layouts without simulating each one:

**The step estimate** (:class:`StepEstimate`) of a layout on the planner's resampled global
batches runs the chain as a synchronous pipeline: every module's stages laid out as
``ModuleGraph.stage_offsets`` places them, at slot t global stage q holds microbatch t - q, and
a slot lasts as long as its slowest stage, where module i's stage time for step k is its slowest
replica's load of that step (replica r takes the r-th contiguous block of the step, loader order
as ``optimize.simulated_ms`` simulates) times its per-sample cost at its TP and SP, over its PP:

    E = mean over batches of  sum over slots t of  max over stages q active at t of  s_q(t - q)

With equal samples it is ``(K + P - 1) * s``, the simulated time; with uneven samples it lies
above the simulation (a synchronous slot waits for every stage, 1F1B's stages drift apart) but
ranks layouts by the per-step maxima the closed form averages away.

**The refinement** (:func:`refine`): a beam of the ``BEAM`` layouts of lowest estimate, starting
from the finalists; each round every layout of the beam is changed in one module at a time to
each of that module's options at the same samples per step (``search.options``: the same
degrees, memory and node rules as the search, checked for the whole layout's pipeline depths),
and the beam becomes the best ``BEAM`` of everything estimated; it stops when the beam no longer
changes or after ``ROUNDS`` rounds. The ``count`` layouts of lowest estimate are returned, for
``optimize.plan`` to simulate beside the finalists. Layouts with adaptive SP groups are left out
(the estimate does not model them; the finalists still carry them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from disttrain_ds.cost.profile import AUTO_SP, Profile
from disttrain_ds.planner.neighbours import Feasible, Layout, degrees_of
from disttrain_ds.planner.objective import Degrees

BEAM = 8
"""Layouts kept between the refinement's rounds."""
ROUNDS = 4
"""Most rounds of one-module changes."""


def _key(layout: Mapping[str, Degrees], names: tuple[str, ...]) -> tuple:
    return tuple(layout[n] for n in names)


class StepEstimate:
    """The synchronous-pipeline estimate of layouts on fixed batches (module docstring)."""

    def __init__(self, profile: Profile, unit_times: np.ndarray) -> None:
        """``unit_times``: ``[batches, global_batch, modules]`` each sample's time per unit of its
        module's mean per-sample cost, modules in ``profile.graph.names`` order, loader order
        (``sim_bound.unit_times`` of the resampled batches)."""
        t = np.asarray(unit_times, dtype=np.float64)
        if t.ndim != 3 or t.shape[1] != profile.global_batch or t.shape[2] != len(profile.graph.names):
            raise ValueError(f"unit_times must be [batches, {profile.global_batch}, "
                             f"{len(profile.graph.names)}], got {list(t.shape)}")
        self.profile, self._t = profile, t
        self._slowest: dict[tuple[int, int, int], np.ndarray] = {}  # (module, dp, m) -> [batches, K]
        # (module, dp, m, pp) -> ([batches, K + pp - 1] slots, their mean sum)
        self._window: dict[tuple[int, int, int, int], tuple[np.ndarray, float]] = {}
        self._names, self._llm = profile.graph.names, profile.graph.llm

    def _slots(self, j: int, dp: int, m: int, pp: int) -> tuple[np.ndarray, float]:
        """``[batches, K + pp - 1]``: at each slot from module j's first stage, the largest
        unit-cost step load among its pp stages' microbatches (0 where none is active); and the
        mean over batches of its sum."""
        key = (j, dp, m, pp)
        if key not in self._window:
            if (j, dp, m) not in self._slowest:
                t = self._t[:, :, j]
                self._slowest[(j, dp, m)] = t.reshape(len(t), -1, dp, m).sum(axis=3).max(axis=2)
            y = self._slowest[(j, dp, m)]
            k = y.shape[1]
            w = np.zeros((len(y), k + pp - 1))
            for stage in range(pp):
                np.maximum(w[:, stage:stage + k], y, out=w[:, stage:stage + k])
            self._window[key] = (w, float(w.sum(axis=1).mean()))
        return self._window[key]

    def _scale(self, name: str, deg: Degrees) -> float:
        return self.profile.modules[name].cost(deg.tp, deg.sp) / deg.pp

    def term(self, name: str, x: Degrees, d: int) -> float:
        """Module ``name``'s slots alone at degrees ``x`` and D = ``d``: no layout holding it
        estimates below this."""
        j = self._names.index(name)
        return self._slots(j, x.dp, d // x.dp, x.pp)[1] * self._scale(name, x)

    def estimate(self, layout: Mapping[str, Degrees]) -> float:
        """The estimate (ms) of ``layout`` (module docstring); its modules' degrees are not
        checked for feasibility."""
        profile, graph = self.profile, self.profile.graph
        d = layout[self._llm].dp * profile.microbatch
        k = profile.global_batch // d
        offsets, stages = graph.stage_offsets({n: layout[n].pp for n in self._names})
        tau = np.zeros((len(self._t), k + stages - 1))
        for j, n in enumerate(self._names):
            x = layout[n]
            w = self._slots(j, x.dp, d // x.dp, x.pp)[0] * self._scale(n, x)
            at = slice(offsets[n], offsets[n] + w.shape[1])
            np.maximum(tau[:, at], w, out=tau[:, at])
        return float(tau.sum(axis=1).mean())


def refine(profile: Profile, starts: list[Layout], estimate: StepEstimate, memo: dict, count: int,
           caps: Mapping[str, int] | None = None, aligned: bool = True) -> list[Layout]:
    """The ``count`` layouts of lowest estimate found by the beam search from ``starts``
    (module docstring), lowest first; ``memo``: ``search.options``' memo of this profile;
    ``caps`` (default: the profile's GPUs) and ``aligned``: the search's per-module GPU caps and
    node rule, which every layout found obeys."""
    names = profile.graph.names
    caps = {n: profile.gpus for n in names} if caps is None else caps
    feasible = Feasible(profile, memo, caps, aligned)
    seen: dict[tuple, tuple[float, Layout]] = {}

    def consider(layout: Layout) -> None:
        key = _key(layout, names)
        if key not in seen and all(x.sp != AUTO_SP for x in layout.values()):
            seen[key] = (estimate.estimate(layout), layout)

    for layout in starts:
        consider(dict(layout))
    if not seen:  # every start has adaptive SP groups: nothing to estimate
        return []
    rank = lambda: sorted(seen, key=lambda x: (seen[x][0], x))  # noqa: E731 (ties: by degrees)

    def best_shapes() -> list[tuple]:
        """The ``BEAM`` best layouts of distinct DP and PP degrees (those differing in TP only
        estimate alike: one of them per shape keeps the beam diverse)."""
        out, shapes = [], set()
        for key in rank():
            shape = tuple((x.dp, x.pp) for x in key)
            if shape not in shapes:
                shapes.add(shape)
                out.append(key)
                if len(out) == BEAM:
                    break
        return out

    beam = best_shapes()
    cut = lambda: max(seen[beam[-1]][0], seen[rank()[min(count, len(seen)) - 1]][0])  # noqa: E731
    candidates: dict[tuple[str, int], list[tuple[float, Degrees]]] = {}
    for _ in range(ROUNDS):
        for key in beam:
            base = seen[key][1]
            d = base[profile.graph.llm].dp * profile.microbatch
            worst = cut()  # what a layout must beat to stay: the beam's last, the count-th best
            terms = [estimate.term(n, base[n], d) for n in names]
            for i, n in enumerate(names):
                if max(terms[:i] + terms[i + 1:], default=0.0) > worst:
                    continue  # the other modules alone already lose
                if (n, d) not in candidates:
                    xs = set(degrees_of(feasible.options(n, d)))  # fewest microbatches in flight: every candidate
                    candidates[(n, d)] = sorted((estimate.term(n, x, d), x) for x in xs if x.sp != AUTO_SP)
                for t, x in candidates[(n, d)]:
                    if t > worst:
                        break  # by their own term, lowest first: the rest lose too
                    if key[:i] + (x,) + key[i + 1:] not in seen:
                        layout = {**base, n: x}
                        if feasible(layout):
                            consider(layout)
        new = best_shapes()
        if new == beam:
            break
        beam = new
    return [seen[key][1] for key in rank()[:count]]

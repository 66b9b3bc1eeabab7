"""A lower bound on the simulated iteration of any layout, cheap enough for millions of layouts.

``iteration_sim.simulate_iteration`` runs every replica-stage's 1F1B ops one after another, a
forward after the same microbatch's forward on every stage before it, a backward before the same
microbatch's backward there; each stage's first op is the first step's forward and its last op
the last step's backward. Take replica r's last stage X of module i (PP = pp): X's own ops take
``busy_r`` (the replica's load over all steps / pp); before its first op the first step's forward
has crossed every stage on a path to X, and after its last op the last step's backward crosses
them again. A stage's forward + backward of one step is its replica's load of that step / its PP
(forward : backward = 1 : ``BACKWARD_FACTOR``). So, with f and b the forward and backward shares:

    T_sim >= max over modules i of ( up_f(i) + up_b(i) + own(i) )
    own(i)  = max over replicas r of ( busy_r + (pp - 1) / pp * (f * L_r(first) + b * L_r(last)) )
    up_f(i) = max over upstream modules u of ( up_f(u) + f * min over replicas of L(first) )

(``up_b`` alike with the last step's loads), where L_r(step) is replica r's load in that step.

Two modes, by what is known of the samples' arrangement:

* ``ordered=False`` (any arrangement, so with intra- and inter-microbatch reordering): a replica
  of a module at m samples per replica per step carries at least the m cheapest samples of the
  batch in any step, and the busiest replica at least the mean (the module's whole work / dp);
* ``ordered=True`` (loader order, no reordering, as ``optimize.simulated_ms`` runs): replica r of
  a module with DP = dp takes the r-th contiguous block of each step, so every term is exact.

Both hold under ``lock_step`` (which only lengthens the simulation); neither with per-module
post-balancing (a replica may take fewer samples) or adaptive SP groups (a group shortens a
sample). Over several batches the terms are averaged before the max over modules, which keeps it
a bound on the mean. For one module with equal samples it is the simulated time itself,
``K * s + (pp - 1) * s`` for stage time s.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.pipeline import split_fwd_bwd

_F, _B = (float(x) for x in split_fwd_bwd(np.float64(1.0)))  # forward and backward shares of a stage's time


class SimBound:
    """Lower bounds on the mean simulated iteration over fixed batches (module docstring)."""

    def __init__(self, graph: ModuleGraph, unit_times: np.ndarray, ordered: bool = False) -> None:
        """``unit_times``: ``[batches, global_batch, modules]`` each sample's fwd+bwd time per unit
        of its module's mean per-sample cost (``iteration_sim.sample_times`` over the same batches,
        divided by each module's cost at the layout's TP), modules in ``graph.names`` order, in
        loader order; ``ordered``: the simulation keeps that order (module docstring)."""
        t = np.asarray(unit_times, dtype=np.float64)
        if t.ndim != 3 or t.shape[2] != len(graph.names):
            raise ValueError(f"unit_times must be [batches, global_batch, {len(graph.names)}], got {list(t.shape)}")
        if (t < 0).any() or not np.isfinite(t).all():
            raise ValueError("unit_times must be non-negative and finite")
        self.graph, self.ordered, self._t = graph, ordered, t
        self.global_batch = t.shape[1]
        self._total = t.sum(axis=1)  # [batches, modules]
        cheapest = np.cumsum(np.sort(t, axis=1), axis=1)  # [batches, global_batch, modules]
        self._cheapest = np.concatenate([np.zeros((len(t), 1, t.shape[2])), cheapest], axis=1)
        self._memo: dict[tuple[int, int, int, int], tuple[float, float, float]] = {}

    def _unit_terms(self, j: int, dp: int, m: int, pp: int) -> tuple[float, float, float]:
        """(own, up_f, up_b) of module j at unit cost, averaged over the batches."""
        key = (j, dp, m, pp)
        if key not in self._memo:
            if self.ordered:
                t = self._t[:, :, j]
                loads = t.reshape(len(t), -1, dp, m).sum(axis=3)  # [batches, steps, dp]
                first, last = loads[:, 0], loads[:, -1]
                own = (loads.sum(axis=1) + (pp - 1) * (_F * first + _B * last)).max(axis=1) / pp
                self._memo[key] = (float(own.mean()), _F * float(first.min(axis=1).mean()),
                                   _B * float(last.min(axis=1).mean()))
            else:
                q = float(self._cheapest[:, m, j].mean())
                own = (float(self._total[:, j].mean()) / dp + (pp - 1) * q) / pp
                self._memo[key] = (own, _F * q, _B * q)
        return self._memo[key]

    def terms(self, name: str, cost: np.ndarray, dp: np.ndarray, pp: np.ndarray,
              per_replica: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(own, up_f, up_b) of module ``name`` at per-sample ``cost`` (ms at its TP), ``dp``
        replicas, ``pp`` stages and ``per_replica`` samples per replica per step (module docstring;
        up_f and up_b: what the module adds to a path through it)."""
        j = self.graph.names.index(name)
        cost, dp, pp, m = np.broadcast_arrays(*(np.asarray(x) for x in (cost, dp, pp, per_replica)))
        if (m < 1).any() or (dp * m > self.global_batch).any() or (self.global_batch % (dp * m)).any():
            raise ValueError(f"dp x per_replica must divide the global batch {self.global_batch}")
        keys = np.stack([dp.ravel(), m.ravel(), pp.ravel()], axis=1).astype(np.int64)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        unit = np.array([self._unit_terms(j, *map(int, k)) for k in uniq]).reshape(-1, 3)[inv.ravel()]
        c = np.asarray(cost, dtype=np.float64).ravel()
        return tuple((c * unit[:, i]).reshape(cost.shape) for i in range(3))

    def bound(self, own: Mapping[str, np.ndarray], up_f: Mapping[str, np.ndarray],
              up_b: Mapping[str, np.ndarray]) -> np.ndarray:
        """The bound for layouts given by each module's ``terms`` (broadcast together)."""
        path_f: dict[str, np.ndarray] = {}
        path_b: dict[str, np.ndarray] = {}
        out: np.ndarray | float = 0.0
        for n in self.graph.names:  # data-flow order: every upstream module comes first
            ups = self.graph.upstream(n)
            path_f[n] = np.maximum.reduce(np.broadcast_arrays(*(path_f[u] + up_f[u] for u in ups))) if ups else 0.0
            path_b[n] = np.maximum.reduce(np.broadcast_arrays(*(path_b[u] + up_b[u] for u in ups))) if ups else 0.0
            out = np.maximum(out, path_f[n] + path_b[n] + own[n])
        return np.asarray(out, dtype=np.float64)


def unit_times(flops: np.ndarray, batches: int) -> np.ndarray:
    """``[batches, n / batches, modules]`` per-sample times at unit mean cost, normalised over all
    of ``flops`` (``[n, modules]``) as ``iteration_sim.sample_times`` normalises them."""
    f = np.asarray(flops, dtype=np.float64)
    mean = f.mean(axis=0)
    unit = np.where(mean > 0, f / np.where(mean > 0, mean, 1.0), 1.0)
    return unit.reshape(batches, -1, f.shape[1])

"""Data heterogeneity in the objective: each stage priced by its expected slowest DP replica.

A module with DP = dp takes D = dp * m samples per pipeline step, m per replica, and every
replica of a lock-step stage waits for the slowest. Given a profile's per-sample draws
(``modules.<name>.sample_cost_ms``), the *straggler factor* of (dp, m) is

    h(dp, m) = E[max_r load_r] / E[mean_r load_r]

over steps of D samples drawn i.i.d. from the draw (with replacement, the i-th entry of every
module belonging to the same sample), where load_r is replica r's summed cost after the
intra-microbatch balancing of :mod:`disttrain_ds.data.reorder`:

* m = 1: no balancing is possible and h is exact: E[max of dp draws] over the draw's mean, from
  the sorted draw x_(1) <= ... <= x_(N): sum_k x_(k) ((k/N)^dp - ((k-1)/N)^dp).
* m >= 2: Monte Carlo with a fixed seed per (dp, m): ceil(``SAMPLES`` / D) steps, each split by
  equal-count LPT (``reorder.lpt_rows``, the first construction ``intra_microbatch_reorder``
  starts from; the runtime keeps the better of it and balanced differencing and then improves by
  swaps, so h over-estimates the runtime's straggler by at most LPT's gap: under 0.3 % of the mean
  load in ``bench/bench_reorder.py``'s draws). Sums are over the same steps for max and mean, so
  h >= 1 holds exactly.

The objective's warm-up term becomes w = (m * C(tp)) * h(dp, m): C(tp) stays the profile's mean
cost and h scales it (TP and PP are assumed to shrink every sample's time by the same factor).
Factors are computed on first use and kept, so a search pays only for the (dp, m) pairs it looks
at; the pairs of one step size D are balanced in one batched LPT (a pair's value does not depend
on which others are computed with it). Without draws every factor is exactly 1.0 and nothing changes.
"""

from __future__ import annotations

import math

import numpy as np

from disttrain_ds.data.reorder import lpt_rows
from disttrain_ds.planner.profile import Profile

SAMPLES = 2048
"""Samples balanced per (dp, m) for m >= 2 (at least one whole step, ``ceil(SAMPLES / D)`` steps)."""
SEED = 0
"""Base seed of the resampled steps."""


def expected_max(sorted_draw: np.ndarray, n: int) -> float:
    """E[max of ``n`` i.i.d. picks] from the empirical distribution of ``sorted_draw``."""
    k = np.arange(1, len(sorted_draw) + 1) / len(sorted_draw)
    return float(np.dot(sorted_draw, k**n - (k - 1 / len(sorted_draw))**n))


class StragglerTable:
    """h(dp, m) per module of one profile, computed on demand and memoised."""

    def __init__(self, profile: Profile, samples: int = SAMPLES, seed: int = SEED) -> None:
        names = [n for n, m in profile.modules.items() if m.sample_cost_ms is not None]
        self.names = tuple(names)
        self._draws = np.array([profile.modules[n].sample_cost_ms for n in names],
                               dtype=np.float64).reshape(len(names), -1)
        self._sorted = np.sort(self._draws, axis=1)
        self._mean = self._draws.mean(axis=1)
        self._samples, self._seed = samples, seed
        self._memo: dict[tuple[int, int], np.ndarray] = {}  # (dp, m) -> h of every module

    def __bool__(self) -> bool:
        return bool(self.names)

    def _balanced(self, d: int, pairs: list[tuple[int, int]]) -> list[np.ndarray]:
        """h of every module for each (dp, m >= 2) in ``pairs``, all with dp * m = ``d``: one
        batched LPT over every pair's steps (ranks past a pair's dp get no room)."""
        steps, k, n = max(1, math.ceil(self._samples / d)), max(dp for dp, _ in pairs), len(self.names)
        costs, room = [], []
        for dp, m in pairs:
            idx = np.random.default_rng([self._seed, dp, m]).integers(0, self._draws.shape[1],
                                                                      (steps, d))
            costs.append(self._draws[:, idx].reshape(-1, d))  # rows: module-major, then step
            room.append(np.broadcast_to(np.where(np.arange(k) < dp, m, 0), (n * steps, k)))
        _, loads = lpt_rows(np.concatenate(costs), np.concatenate(room))
        out = []
        for j, (dp, _) in enumerate(pairs):
            mine = loads[j * n * steps:(j + 1) * n * steps]
            peak = mine.max(axis=1).reshape(n, steps).sum(axis=1)
            mean = (mine.sum(axis=1) / dp).reshape(n, steps).sum(axis=1)
            out.append(peak / mean)
        return out

    def _fill(self, pairs: set[tuple[int, int]]) -> None:
        """Compute and memoise h for ``pairs`` (dp, m) not yet known."""
        todo = sorted(p for p in pairs if p not in self._memo)
        by_step: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for dp, m in todo:  # batched by step size and by dp rounded up to a power of two
            if m == 1:
                h = np.array([expected_max(s, dp) / mu for s, mu in zip(self._sorted, self._mean)])
                self._memo[(dp, m)] = np.maximum(h, 1.0)  # h >= 1 despite rounding
            else:
                by_step.setdefault((dp * m, 1 << (dp - 1).bit_length()), []).append((dp, m))
        for (d, _), group in by_step.items():
            for pair, h in zip(group, self._balanced(d, group)):
                self._memo[pair] = np.maximum(h, 1.0)

    def factor(self, name: str, dp: int, m: int) -> float:
        """h(dp, m) of module ``name``; 1.0 for a module without a draw."""
        if name not in self.names:
            return 1.0
        key = (int(dp), int(m))
        self._fill({key})
        return float(self._memo[key][self.names.index(name)])

    def factors(self, name: str, dp: np.ndarray, m: np.ndarray) -> np.ndarray:
        """``factor`` elementwise over broadcast integer arrays ``dp`` and ``m``."""
        dp, m = np.broadcast_arrays(np.asarray(dp, dtype=np.int64), np.asarray(m, dtype=np.int64))
        if name not in self.names:
            return np.ones(dp.shape)
        pairs, inverse = np.unique(np.stack([dp.ravel(), m.ravel()]), axis=1, return_inverse=True)
        keys = [(int(a), int(b)) for a, b in pairs.T]
        self._fill(set(keys))
        j = self.names.index(name)
        values = np.array([self._memo[k][j] for k in keys], dtype=np.float64)
        return values[inverse.reshape(-1)].reshape(dp.shape)

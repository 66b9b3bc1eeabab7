"""Data heterogeneity in the objective: stages priced by their expected slowest replica.

A module with DP = dp takes D = dp * m samples per pipeline step, m per replica, and every
replica of a lock-step stage waits for the slowest. Given a profile's per-sample draws
(``modules.<name>.sample_cost_ms``), steps of D samples are drawn i.i.d. from the draw (with
replacement; entry i of every module is the same sample) and split over the replicas by the
intra-microbatch balancing of :mod:`disttrain_ds.reorder.intra`. With Y a step's slowest replica
load and L its mean replica load, two factors scale the mean-cost terms:

* warm-up, h(dp, m) = E[Y] / E[L]: one microbatch crossing the module meets one step's straggler;
* stage time, g(dp, m, pp) = E[max of pp independent Y] / E[L]: in 1F1B's steady state the pp
  stages of a module work on pp different microbatches at once and hand work along, so a slow
  microbatch on any stage paces the others (simulated 1F1B of one module with i.i.d. step times
  tracks this within a few per cent up to pp = 16, see ``docs/planner.md``). g(dp, m, 1) = h.

A draw may hold zeros (a sample without images costs an encoder nothing): they take part like any
cost; a module whose draw is all zeros gets factor 1 (it never waits on the data).

Estimates, stated: for m = 1 no balancing is possible and both are exact for the draw's empirical
distribution (Y is the max of dp draws, the max of pp such Y the max of dp * pp draws), from the
sorted draw x_(1) <= ... <= x_(N): E[max of n] = sum_k x_(k) ((k/N)^n - ((k-1)/N)^n). For m >= 2
they are Monte Carlo with a fixed seed per (dp, m): ``max(MIN_STEPS, ceil(SAMPLES / D))`` steps,
each split by equal-count LPT (``reorder.lpt_rows``, the construction ``intra_microbatch_reorder``
starts from; the runtime keeps the better of it and balanced differencing and improves it by
swaps, so Y is over-estimated by at most LPT's gap: under 0.3 % of the mean load on
``bench/bench_reorder.py``'s draws); E[max of pp Y] is taken over the steps' empirical Y. Max and
mean are summed over the same steps, so h >= 1 (and g >= h up to rounding; both are clamped
at 1).

With ``Profile.post_balance_share`` (the runtime's ``parallel.post_balance``) every module but the
LLM splits a step by LPT with room for up to that share of its units per replica (``share_cap``),
as its post-balancing allows: a module with a unit draw (``unit_cost_ms``: an encoder's images, a
generator's target images) splits the units of the step's samples, for m = 1 too; one without
splits whole samples. The runtime's assignment then improves on LPT by moves and swaps.

The objective's terms become w = (m * C(tp)) * h and s = ((m * C(tp)) * g) / pp: C(tp) stays the
profile's mean cost and the factors scale it (TP and PP shrink every sample's time alike).
Factors are computed on first use and kept, so a search pays only for the (dp, m) pairs it looks
at; the pairs of one step size D are balanced in one batched LPT (a pair's value does not depend
on which others are computed with it). Without draws no factor is applied and nothing changes.

Adaptive SP (``sp: auto``, ``AUTO_SP``): a step's replicas regroup by its samples' costs
(``planner/sp_auto.py``, the runtime's own group search on the draw), each replica taking its
group's time; h and g are then the same ratios over ``max(AUTO_MIN_STEPS, ceil(AUTO_SAMPLES / D))``
steps with the seeds of SP 1's (the two compare on the same steps), per (dp, m, tp): the
all-to-alls' share of a sample's time depends on TP.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from disttrain_ds.cost.profile import Profile
from disttrain_ds.planner.sp_auto import draw_cost, step_loads
from disttrain_ds.reorder.intra import lpt_rows
from disttrain_ds.reorder.post_balance import flat_units, share_cap, unit_rows

SAMPLES = 2048
"""Samples balanced per (dp, m) with m >= 2 (``max(MIN_STEPS, ceil(SAMPLES / D))`` steps)."""
MIN_STEPS = 8
"""Fewest resampled steps per (dp, m) with m >= 2 (the spread of Y needs several)."""
SEED = 0
"""Base seed of the resampled steps."""
AUTO_SAMPLES = 512
"""Samples grouped per (dp, m, tp) for adaptive SP (its group search runs step by step)."""
AUTO_MIN_STEPS = 8
"""Fewest resampled steps per (dp, m, tp) for adaptive SP."""


@functools.lru_cache(maxsize=4096)
def _max_weights(size: int, n: int) -> np.ndarray:
    """Weights w with E[max of ``n`` i.i.d. picks] = sorted values . w over ``size`` values."""
    k = np.arange(1, size + 1) / size
    return k**n - (k - 1 / size)**n


def expected_max(sorted_draw: np.ndarray, n: int) -> float:
    """E[max of ``n`` i.i.d. picks] from the empirical distribution of ``sorted_draw``."""
    return float(np.dot(sorted_draw, _max_weights(len(sorted_draw), n)))


class StragglerTable:
    """h(dp, m) and g(dp, m, pp) per module of one profile, computed on demand and memoised."""

    def __init__(self, profile: Profile, samples: int = SAMPLES, seed: int = SEED) -> None:
        names = [n for n, m in profile.modules.items() if m.sample_cost_ms is not None]
        self.names = tuple(names)
        # Post-balanced modules (all but the LLM) split a step unevenly, up to this share per replica.
        self._share = np.array([profile.post_balance_share if n != profile.graph.llm else 0.0 for n in names])
        self._draws = np.array([profile.modules[n].sample_cost_ms for n in names],
                               dtype=np.float64).reshape(len(names), -1)
        # Post-balanced modules with a unit draw split units (images, targets), not samples:
        # per module, every unit's ms in sample order and each sample's first unit and count.
        self._units: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
        for n, share in zip(names, self._share):
            units = profile.modules[n].unit_cost_ms
            self._units.append(flat_units(units) if share and units is not None else None)
        self._sorted = np.sort(self._draws, axis=1)
        self._mean = self._draws.mean(axis=1)
        self._samples, self._seed = samples, seed
        # (dp, m) -> ([modules, steps] sorted step maxima Y, [modules] mean L); None for m = 1
        self._steps: dict[tuple[int, int], tuple[np.ndarray, np.ndarray] | None] = {}
        self._memo: dict[tuple[int, int, int], np.ndarray] = {}  # (dp, m, pp) -> g per module
        # ``_memo`` as arrays for ``factors``: sorted codes of (dp, m, pp) and g per module per code
        self._codes = np.zeros(0, dtype=np.int64)
        self._values = np.zeros((0, len(names)))
        self._exact: dict[int, np.ndarray] = {}  # n -> E[max of n draws] / mean per module
        self._llm = profile.graph.llm
        self._sp = {n: (dict(profile.modules[n].sp_overhead_ms), dict(profile.modules[n].cost_ms)) for n in names}
        # (name, dp, m, tp) -> (sorted step maxima Y, mean L) under adaptive SP groups
        self._auto: dict[tuple[str, int, int, int], tuple[np.ndarray, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.names)

    def _balanced(self, d: int, pairs: list[tuple[int, int]]) -> None:
        """Step maxima of every module for each (dp, m) in ``pairs``, all with dp * m = ``d``:
        one batched LPT over every pair's steps (ranks past a pair's dp get no room; a module
        splitting units has rows of its steps' units, zero-padded). With dp = 1 the one replica
        takes the whole step: its load is the step's sum, no LPT needed."""
        steps = max(MIN_STEPS, math.ceil(self._samples / d))
        n = len(self.names)
        blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (costs, counted, cap) per pair and module
        for dp, m in pairs:
            idx = np.random.default_rng([self._seed, dp, m]).integers(0, self._draws.shape[1], (steps, d))
            for j in range(n):
                if self._units[j] is None:
                    cost, real = self._draws[j][idx], np.ones((steps, d), dtype=bool)
                    cap = np.full(steps, share_cap(d, dp, self._share[j]) if self._share[j] else m)
                else:
                    cost, real = unit_rows(*self._units[j], idx)
                    slots = real.sum(axis=1)  # share_cap, vectorised over the steps' unit counts
                    cap = np.minimum(slots, np.ceil(slots / dp * self._share[j]).astype(np.int64))
                blocks.append((cost, real, cap))
        spread = [i for i, (dp, _) in enumerate(pairs) if dp > 1]
        loads: dict[int, np.ndarray] = {}  # pair -> [n * steps, dp] replica loads
        if spread:
            k = max(pairs[i][0] for i in spread)
            width = max(blocks[i * n + j][0].shape[1] for i in spread for j in range(n))
            rows = len(spread) * n * steps
            cost, real = np.zeros((rows, width)), np.zeros((rows, width), dtype=bool)
            room = np.zeros((rows, k), dtype=np.int64)
            for slot, i in enumerate(spread):
                for j in range(n):
                    c, r, cap = blocks[i * n + j]
                    at = slice((slot * n + j) * steps, (slot * n + j + 1) * steps)
                    cost[at, :c.shape[1]], real[at, :c.shape[1]] = c, r
                    room[at, :pairs[i][0]] = cap[:, None]
            _, every = lpt_rows(cost, room, real)
            for slot, i in enumerate(spread):
                loads[i] = every[slot * n * steps:(slot + 1) * n * steps, :pairs[i][0]]
        for i, (dp, m) in enumerate(pairs):
            mine = loads.get(i)
            if mine is None:
                mine = np.concatenate([blocks[i * n + j][0].sum(axis=1) for j in range(n)])[:, None]
            peak = mine.max(axis=1).reshape(n, steps)
            mean = (mine.sum(axis=1) / dp).reshape(n, steps).sum(axis=1) / steps
            self._steps[(dp, m)] = (np.sort(peak, axis=1), mean)

    def _fill(self, keys: set[tuple[int, int, int]]) -> None:
        """Compute and memoise g for ``keys`` (dp, m, pp) not yet known."""
        todo = sorted(k for k in keys if k not in self._memo)
        by_step: dict[int, list[tuple[int, int]]] = {}
        units = any(u is not None for u in self._units)
        for dp, m, _ in todo:  # batched by step size: one LPT loop over a step's samples
            if m == 1 and not units:
                self._steps[(dp, m)] = None
            elif (dp, m) not in self._steps:
                group = by_step.setdefault(dp * m, [])
                if (dp, m) not in group:
                    group.append((dp, m))
        for d, group in by_step.items():
            self._balanced(d, group)
        for dp, m, pp in todo:
            steps = self._steps[(dp, m)]
            if steps is None:  # one sample per replica: the max of dp * pp draws
                g = self._max_of(dp * pp)
            else:  # steps in which a module had no work at all wait for nothing there
                y, mu = steps
                g = np.where(mu > 0, (y @ _max_weights(y.shape[1], pp)) / np.where(mu > 0, mu, 1.0), 1.0)
                if m == 1:  # modules splitting whole samples: exact, as above
                    whole = np.array([u is None for u in self._units])
                    g = np.where(whole, self._max_of(dp * pp), g)
            self._memo[(dp, m, pp)] = np.maximum(g, 1.0)  # >= 1 despite rounding

    def _max_of(self, n: int) -> np.ndarray:
        """E[max of n draws] / mean of every module (memoised: m = 1 depends on dp * pp only)."""
        if n not in self._exact:
            self._exact[n] = np.array([expected_max(x, n) / mu if mu > 0 else 1.0
                                       for x, mu in zip(self._sorted, self._mean)])
        return self._exact[n]

    def factor(self, name: str, dp: int, m: int, pp: int = 1) -> float:
        """g(dp, m, pp) of module ``name`` (h(dp, m) with pp = 1); 1.0 without a draw."""
        if name not in self.names:
            return 1.0
        key = (int(dp), int(m), int(pp))
        self._fill({key})
        return float(self._memo[key][self.names.index(name)])

    def auto_factor(self, name: str, dp: int, m: int, pp: int, tp: int) -> float:
        """g(dp, m, pp) of module ``name`` at TP ``tp`` under adaptive SP groups (module docstring;
        h with pp = 1)."""
        key = (name, int(dp), int(m), int(tp))
        if key not in self._auto:
            j = self.names.index(name)
            d = key[1] * key[2]
            steps = max(AUTO_MIN_STEPS, math.ceil(AUTO_SAMPLES / d))
            idx = np.random.default_rng([self._seed, key[1], key[2]]).integers(0, self._draws.shape[1], (steps, d))
            overhead, cost = self._sp[name]
            units = self._draws[j][idx] / self._mean[j] if self._mean[j] > 0 else np.zeros((steps, d))
            price = draw_cost(overhead, cost[key[3]], key[3])
            peak = [step_loads(row, key[1], price, name == self._llm).max() for row in units]
            self._auto[key] = (np.sort(peak), float(units.sum() / key[1] / steps))
        y, mu = self._auto[key]
        return max(expected_max(y, int(pp)) / mu, 1.0) if mu > 0 else 1.0

    def auto_factors(self, name: str, dp: np.ndarray, m: np.ndarray, pp: np.ndarray | int, tp: np.ndarray
                     ) -> np.ndarray:
        """``auto_factor`` elementwise over broadcast integer arrays."""
        dp, m, pp, tp = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (dp, m, pp, tp)))
        return np.array([self.auto_factor(name, a, b, c, t) for a, b, c, t in
                         zip(dp.ravel(), m.ravel(), pp.ravel(), tp.ravel())], dtype=np.float64).reshape(dp.shape)

    def factors(self, name: str, dp: np.ndarray, m: np.ndarray, pp: np.ndarray | int = 1
                ) -> np.ndarray:
        """``factor`` elementwise over broadcast integer arrays ``dp``, ``m`` and ``pp``."""
        dp, m, pp = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (dp, m, pp)))
        if name not in self.names:
            return np.ones(dp.shape)
        # One int64 per (dp, m, pp) (each < 2**21), looked up in the sorted codes of known keys.
        code = ((dp << 42) | (m << 21) | pp).ravel()
        pos = np.searchsorted(self._codes, code)
        known = self._codes[np.minimum(pos, len(self._codes) - 1)] == code if len(self._codes) else \
            np.zeros(code.shape, dtype=bool)
        if not known.all():
            new = np.unique(code[~known])
            self._fill({(int(c >> 42), int((c >> 21) & 0x1FFFFF), int(c & 0x1FFFFF)) for c in new})
            codes = np.concatenate([self._codes, new])
            order = np.argsort(codes, kind="stable")
            self._codes = codes[order]
            self._values = np.concatenate([self._values, np.array(
                [self._memo[(int(c >> 42), int((c >> 21) & 0x1FFFFF), int(c & 0x1FFFFF))] for c in new]
            ).reshape(len(new), len(self.names))])[order]
            pos = np.searchsorted(self._codes, code)
        return self._values[pos, self.names.index(name)].reshape(dp.shape)

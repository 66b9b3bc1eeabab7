"""Per-module post-balancing (OrchMLLM's dispatcher): each module splits a microbatch over its own replicas.

Every microbatch slot is one ordered list of samples. The LLM keeps its contiguous, equal blocks
(its order and packing), but every other module assigns its own units of the slot to its replicas
by its own per-unit costs: an encoder its items (images, audio clips: one sequence's images may be
encoded on several replicas), a generator its target images. Counts may differ
between replicas (within ``[floor, cap]``). ``runtime/placement.py`` makes the placement; the
boundary routes then carry each unit's rows from the replica that computed them to the one that
needs them (``comm/routes.py``).

``assign`` minimises the largest replica load (among equals it prefers a smaller sum of squared
loads, best effort): the LPT schedule, then moves and swaps off the most loaded replica, then, unless
that already meets the lower bound or the slot is large, a depth-first search over the
heaviest-first assignment that proves the optimum or stops at a node budget. Everything is deterministic: the
same costs give the same assignment on every rank, with no clock involved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

NODE_BUDGET = 2_000
"""Search nodes ``assign`` may visit after its local search (a bound on time, the same everywhere)."""
GOOD_ENOUGH = 1e-3
"""The local search stops once the largest load is within this fraction of the lower bound."""
HOME_GAIN = 0.01
"""With a home replica per unit: a unit leaves home only when that lowers the slot's largest load
by more than this fraction (each unit away from home makes two replicas wait on each other)."""
SEARCH_MAX = 16
"""Slots of at most this many samples are searched after the local search."""
_EPS = 1e-12


def _check(costs: Sequence[float], replicas: int, floor: int, cap: int) -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1 or not np.isfinite(c).all() or (c < 0).any():
        raise ValueError("costs must be a 1-D sequence of finite values >= 0")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if not 0 <= floor <= cap or floor * replicas > len(c) or cap * replicas < len(c):
        raise ValueError(f"{len(c)} samples do not fit {replicas} replicas of {floor}..{cap} samples each")
    return c


def _score(loads: np.ndarray) -> tuple[float, float]:
    return float(loads.max()), float((loads * loads).sum())


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = _EPS * max(1.0, abs(b[0]))
    return a[0] < b[0] - tol or (a[0] <= b[0] + tol and a[1] < b[1] - _EPS * max(1.0, b[1]))


def _lpt(c: np.ndarray, replicas: int, floor: int, cap: int) -> np.ndarray:
    """Heaviest first to the least-loaded replica with room (ties: the lowest index); the last
    samples fill replicas still short of ``floor``."""
    owner = np.empty(len(c), dtype=np.int64)
    loads, counts = np.zeros(replicas), np.zeros(replicas, dtype=np.int64)
    order = np.argsort(-c, kind="stable")
    for k, i in enumerate(order):
        left = len(c) - k
        short = np.maximum(floor - counts, 0)
        room = counts < cap
        if short.sum() >= left:  # the rest must go to replicas below their floor
            room &= short > 0
        r = int(np.flatnonzero(room)[np.argmin(loads[room])])
        owner[i] = r
        loads[r] += c[i]
        counts[r] += 1
    return owner


def _improve(c: np.ndarray, owner: np.ndarray, replicas: int, floor: int, cap: int, rounds: int,
             min_gain: float = 0.0) -> np.ndarray:
    """Best single move or swap involving the most loaded replica, while the score drops (every
    candidate of a round priced at once); ``min_gain`` > 0: only while the largest load drops by
    more than that fraction of it."""
    owner = owner.copy()
    loads = np.bincount(owner, weights=c, minlength=replicas)
    counts = np.bincount(owner, minlength=replicas)
    best = _score(loads)
    bound = lower_bound(c, replicas) * (1 + GOOD_ENOUGH)
    for _ in range(rounds):
        if best[0] <= bound:  # within a hair of what no split beats: further moves are not worth their time
            break
        hot = int(np.argmax(loads))
        mine, others = np.flatnonzero(owner == hot), np.flatnonzero(owner != hot)
        # Moves: sample i of the hot replica to replica r; swaps: i with a lighter j elsewhere.
        mi, mr = np.meshgrid(mine, np.arange(replicas), indexing="ij")
        ok = (mr != hot) & (counts[mr] < cap) & (counts[hot] > floor)
        mi, mr = mi[ok], mr[ok]
        si, sj = np.meshgrid(mine, others, indexing="ij")
        ok = c[sj] < c[si]
        si, sj = si[ok], sj[ok]
        src = np.concatenate([mi, si])
        dst = np.concatenate([mr, owner[sj]])
        delta = np.concatenate([c[mi], c[si] - c[sj]])  # what leaves the hot replica for dst
        if len(delta) == 0:
            break
        trial = np.repeat(loads[None], len(delta), axis=0)
        rows = np.arange(len(delta))
        trial[rows, hot] -= delta
        trial[rows, dst] += delta
        top, sq = trial.max(axis=1), (trial * trial).sum(axis=1)
        tol = _EPS * max(1.0, best[0])
        if min_gain > 0:
            better = top < best[0] * (1 - min_gain)
        else:
            better = (top < best[0] - tol) | ((top <= best[0] + tol) & (sq < best[1] - _EPS * max(1.0, best[1])))
        if not better.any():
            break
        k = np.flatnonzero(better)[np.lexsort((sq[better], top[better]))[0]]
        i, r = int(src[k]), int(dst[k])
        if k < len(mi):  # a move
            owner[i] = r
            counts[hot] -= 1
            counts[r] += 1
        else:
            j = int(sj[k - len(mi)])
            owner[i], owner[j] = r, hot
        loads = trial[k]
        best = (float(top[k]), float(sq[k]))
    return owner


def _search(c: np.ndarray, owner: np.ndarray, replicas: int, floor: int, cap: int, budget: int) -> np.ndarray:
    """Depth-first search over assignments of the samples heaviest first, pruned by the incumbent's
    largest load; returns the best found (optimal when the search finishes within ``budget``)."""
    order = np.argsort(-c, kind="stable")
    w = c[order]
    suffix = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])
    best_owner, best = owner.copy(), _score(np.bincount(owner, weights=c, minlength=replicas))
    loads, counts = np.zeros(replicas), np.zeros(replicas, dtype=np.int64)
    pick = np.empty(len(c), dtype=np.int64)
    nodes = 0

    def visit(k: int) -> None:
        nonlocal nodes, best, best_owner
        nodes += 1
        if nodes > budget:
            return
        if k == len(w):
            s = _score(loads)
            if _better(s, best):
                best = s
                best_owner = np.empty(len(c), dtype=np.int64)
                best_owner[order] = pick
            return
        # Bound: even spread of what is left cannot beat the incumbent's largest load.
        if max(loads.max(), (loads.sum() + suffix[k]) / replicas) > best[0] + _EPS * max(1.0, best[0]):
            return
        left = len(w) - k
        need = int(np.maximum(floor - counts, 0).sum())
        tried: set[tuple[float, int]] = set()
        for r in np.argsort(loads, kind="stable"):
            r = int(r)
            if counts[r] >= cap or (need >= left and counts[r] >= floor):
                continue
            key = (round(float(loads[r]), 12), int(counts[r]))
            if key in tried:  # replicas alike so far lead to the same subtrees
                continue
            tried.add(key)
            if loads[r] + w[k] > best[0] + _EPS * max(1.0, best[0]):
                continue
            loads[r] += w[k]
            counts[r] += 1
            pick[k] = r
            visit(k + 1)
            loads[r] -= w[k]
            counts[r] -= 1
            if nodes > budget:
                return

    visit(0)
    return best_owner


def assign(costs: Sequence[float], replicas: int, floor: int = 1, cap: int | None = None,
           budget: int = NODE_BUDGET, home: Sequence[int] | None = None) -> list[list[int]]:
    """Sample positions per replica (each ascending) that minimise the most loaded replica's summed
    cost, each replica taking ``floor``..``cap`` samples (``cap`` None: any number). Deterministic;
    on slots of up to ``SEARCH_MAX`` samples the largest load is optimal when the search ends within
    ``budget`` nodes.

    ``home``: the replica each unit would take without balancing (its contiguous block's). The
    local search then starts there too, moving a unit only when that lowers the largest load by
    more than ``HOME_GAIN``, and its result is kept when it is within ``HOME_GAIN`` of the lower
    bound (no search from LPT then) or of the search from LPT: units leave home only where balance
    needs it, so fewer replicas wait on one another across a boundary."""
    cap = len(costs) if cap is None else cap
    c = _check(costs, replicas, floor, cap)
    if replicas == 1:
        return [list(range(len(c)))]
    kept = None
    if home is not None:
        h = np.asarray(home, dtype=np.int64)
        counts = np.bincount(h, minlength=replicas)
        if len(h) != len(c) or h.min(initial=0) < 0 or h.max(initial=0) >= replicas:
            raise ValueError(f"home must name one of {replicas} replicas for each of {len(c)} units")
        if counts.min() >= floor and counts.max() <= cap:
            kept = _improve(c, h, replicas, floor, cap, rounds=4 * len(c), min_gain=HOME_GAIN)
            if _top(c, kept, replicas) <= lower_bound(c, replicas) * (1 + HOME_GAIN):
                return _groups(kept, replicas)  # within HOME_GAIN of the optimum: nothing else pays
    owner = _lpt(c, replicas, floor, cap)
    owner = _improve(c, owner, replicas, floor, cap, rounds=4 * len(c))
    # The search proves small slots optimal; on larger ones it never beat the local search on the
    # paper's draws (bench/bench_post_balance.py) and only costs time.
    if len(c) <= SEARCH_MAX and _top(c, owner, replicas) > lower_bound(c, replicas) * (1 + 1e-9):
        owner = _search(c, owner, replicas, floor, cap, budget)
    if kept is not None and _top(c, kept, replicas) <= _top(c, owner, replicas) * (1 + HOME_GAIN):
        owner = kept
    return _groups(owner, replicas)


def _top(c: np.ndarray, owner: np.ndarray, replicas: int) -> float:
    return float(np.bincount(owner, weights=c, minlength=replicas).max())


def _groups(owner: np.ndarray, replicas: int) -> list[list[int]]:
    return [sorted(int(i) for i in np.flatnonzero(owner == r)) for r in range(replicas)]


def share_cap(slot: int, replicas: int, max_share: float) -> int:
    """The most units (samples, items or target images) one replica of ``replicas`` takes from a
    slot of ``slot`` units: ``max_share`` (>= 1) times the even share, rounded up (what the memory
    estimate counts)."""
    return min(slot, math.ceil(slot / replicas * max_share))


def flat_units(units: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample unit costs as flat arrays: every unit in sample order, each sample's first unit, its count."""
    count = np.array([len(u) for u in units], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    return np.array([v for u in units for v in u], dtype=np.float64), first, count


def unit_rows(flat: np.ndarray, first: np.ndarray, count: np.ndarray, idx: np.ndarray,
              scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The units of each row of sample indices ``idx`` (``[rows, n]``; ``flat_units``' arrays),
    left-aligned and zero-padded: ``(costs, real)``, both ``[rows, width]``; ``scale`` (one per
    sample index) multiplies each sample's units."""
    per = count[idx]
    total = per.sum(axis=1)
    width = max(int(total.max(initial=0)), 1)
    n = int(total.sum())
    block = np.repeat(np.cumsum(per.ravel()) - per.ravel(), per.ravel())
    values = flat[np.repeat(first[idx].ravel(), per.ravel()) + np.arange(n) - block]
    if scale is not None:
        values = values * np.repeat(np.asarray(scale)[idx].ravel(), per.ravel())
    row = np.repeat(np.arange(len(idx)), total)
    col = np.arange(n) - np.repeat(np.cumsum(total) - total, total)
    costs, real = np.zeros((len(idx), width)), np.zeros((len(idx), width), dtype=bool)
    costs[row, col], real[row, col] = values, True
    return costs, real


def lower_bound(costs: Sequence[float], replicas: int) -> float:
    """No assignment's largest load is below this: the mean load, or for every k >= 0 the sum of
    the k + 1 lightest of the k * replicas + 1 heaviest units (some replica holds k + 1 of those;
    k = 0: the heaviest unit; equal units: ceil(n / replicas) of them)."""
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    if len(c) == 0:
        return 0.0
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    k = np.arange((len(c) - 1) // replicas + 1)
    top = k * replicas + 1
    return float(max(prefix[-1] / replicas, (prefix[top] - prefix[top - k - 1]).max()))


def load_ratio(costs: Sequence[float], groups: Sequence[Sequence[int]]) -> float:
    """Largest over mean replica load of ``groups`` (1.0 when nothing is to be done)."""
    c = np.asarray(costs, dtype=np.float64)
    loads = np.array([c[list(g)].sum() for g in groups])
    mean = loads.mean() if len(loads) else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def owners_of(groups: Sequence[Sequence[int]]) -> list[int]:
    """The replica of each slot position, from each replica's positions."""
    out = [-1] * sum(len(g) for g in groups)
    for r, g in enumerate(groups):
        for p in g:
            out[p] = r
    return out

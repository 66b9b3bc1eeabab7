"""Inter-microbatch reordering: the execution order of a global batch's microbatches that
minimises the simulated 1F1B makespan (:mod:`disttrain_ds.schedule.simulate`): DistTrain's
interval-filling order, improved by a seeded swap / insertion local search (exhaustive for a few
microbatches). Pure and deterministic for a given input (only a time budget that runs out can make
two calls differ).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable

import numpy as np

from disttrain_ds.schedule.simulate import Comm, Costs2D, check_costs, comm_matrix, makespan_batch, stage_order

_EPS = 1e-12
"""Relative tolerance of makespan comparisons."""

def paper_inter_order(fwd: Costs2D, bwd: Costs2D, comm: Comm = None) -> list[int]:
    """DistTrain's interval-filling order (arXiv 2408.04275, inter-microbatch reordering).

    The ``p - 1`` smallest microbatches (by total time) go last, so the cool-down drains fast;
    the next smallest open the pipeline, so warm-up bubbles are short. Each later slot ``k``
    starts on stage 0 after the backward of slot ``k - p``, and stage 0 then idles until the
    backward of slot ``k - p + 1`` returns; that interval depends only on slots already placed.
    It is filled with the remaining microbatch whose stage-0 forward is the longest that fits
    (or the shortest if none fits).
    """
    f, b = check_costs(fwd, bwd)
    m, p = f.shape
    c = comm_matrix(comm, m, p)
    size = (f + b).sum(axis=1)
    ascending = [int(i) for i in np.argsort(size, kind="stable")]
    if p == 1 or m <= p:
        return ascending
    tail = ascending[:p - 1][::-1]  # the smallest microbatch runs last
    pool = ascending[p - 1:]
    order = pool[:p]  # back-to-back warm-up forwards on stage 0: smallest first
    pool = pool[p:]
    orders = [stage_order(m, p, s) for s in range(p)]
    ptr, free = [0] * p, [0.0] * p
    ends: dict[tuple[int, int, int], float] = {}

    def advance() -> None:
        # Run every op whose microbatch is placed and whose dependency is done.
        progressed = True
        while progressed:
            progressed = False
            for s in range(p):
                while ptr[s] < len(orders[s]):
                    kind, i = orders[s][ptr[s]]
                    if i >= len(order):
                        break
                    if kind == 0 and s > 0:
                        dep, lag = ends.get((s - 1, 0, i)), c[order[i], s - 1]
                    elif kind == 1 and s < p - 1:
                        dep, lag = ends.get((s + 1, 1, i)), c[order[i], s]
                    else:
                        dep, lag = 0.0, 0.0
                    if dep is None:
                        break
                    cost = (f if kind == 0 else b)[order[i], s]
                    free[s] = ends[(s, kind, i)] = max(free[s], dep + lag) + cost
                    ptr[s] += 1
                    progressed = True

    for k in range(p, m - (p - 1)):
        advance()
        start = ends[(0, 1, k - p)]
        arrival = ends[(1, 1, k - p + 1)] + c[order[k - p + 1], 0]
        interval = arrival - start
        fits = [i for i in pool if f[i, 0] <= interval + _EPS]
        if fits:
            pick = max(fits, key=lambda i: (f[i, 0], -i))
        else:
            pick = min(pool, key=lambda i: (f[i, 0], i))
        pool.remove(pick)
        order.append(pick)
    return order + pool + tail


def _moves(m: int, rng: np.random.Generator | None, count: int, edge: int) -> np.ndarray:
    """Swap (kind 0) and insertion (kind 1) moves as rows (kind, i, j); all of them when
    ``rng`` is None, else ``count`` random ones, half touching the first/last ``edge`` slots
    where 1F1B bubbles sit."""
    if rng is None:
        pairs = np.array([(i, j) for i in range(m) for j in range(m) if i != j], dtype=np.int64)
        swaps = pairs[pairs[:, 0] < pairs[:, 1]]
        return np.concatenate([np.column_stack([np.zeros(len(swaps), np.int64), swaps]),
                               np.column_stack([np.ones(len(pairs), np.int64), pairs])])
    i = rng.integers(0, m, count)
    near = rng.random(count) < 0.5
    edges = np.concatenate([np.arange(min(edge, m)), np.arange(max(m - edge, 0), m)])
    i[near] = edges[rng.integers(0, len(edges), int(near.sum()))]
    j = (i + rng.integers(1, m, count)) % m
    return np.column_stack([rng.integers(0, 2, count), i, j])


def _apply_moves(order: np.ndarray, moves: np.ndarray) -> np.ndarray:
    out = np.repeat(order[None, :], len(moves), axis=0)
    for r, (kind, i, j) in enumerate(moves):
        if kind == 0:
            out[r, i], out[r, j] = order[j], order[i]
        else:  # take slot i out and reinsert it at slot j
            row = np.delete(order, i)
            out[r] = np.insert(row, j, order[i])
    return out


def _local_search(f: np.ndarray, b: np.ndarray, c: np.ndarray, order: np.ndarray, span: float,
                  rng: np.random.Generator, batch: int, deadline: float,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[np.ndarray, float]:
    """Steepest-descent over swap/insertion moves until a local optimum or the deadline."""
    m, p = f.shape
    neighbourhood = 3 * m * (m - 1) // 2
    full = neighbourhood <= 8 * batch  # small: scan every move, stop at a local optimum
    misses = 0
    while clock() < deadline:
        moves = _moves(m, None if full else rng, batch, p)
        improved = False
        for lo in range(0, len(moves), batch):
            cands = _apply_moves(order, moves[lo:lo + batch])
            spans = makespan_batch(f, b, cands, c)
            k = int(np.argmin(spans))
            if spans[k] < span - _EPS * max(1.0, span):
                order, span, improved = cands[k], float(spans[k]), True
                if not full:
                    break
            if clock() >= deadline:
                break
        misses = 0 if improved else misses + 1
        # Sampled moves: stop once about one neighbourhood's worth brought nothing.
        if (full and not improved) or misses * batch >= neighbourhood:
            break
    return order, span


def inter_microbatch_reorder(fwd: Costs2D, bwd: Costs2D, comm: Comm = None, *,
                             time_budget_s: float = 1.0, exhaustive_max: int = 8,
                             batch: int = 192, restarts: int = 30, seed: int = 0,
                             clock: Callable[[], float] = time.perf_counter) -> list[int]:
    """Execution order of microbatches minimising the simulated 1F1B makespan.

    ``fwd[i][s]``/``bwd[i][s]``: time of microbatch ``i`` on stage ``s``; ``comm`` as in
    :func:`disttrain_ds.schedule.simulate.comm_matrix` (per-microbatch rows follow ``i``).
    Up to ``exhaustive_max`` microbatches (and while m! * m * p <= 4e6) every permutation is
    tried. Otherwise the best of
    input order and :func:`paper_inter_order` is improved by swap/insertion local search
    (steepest move per batch of ``batch`` candidates), then up to ``restarts`` times kicked by
    two random swaps and searched again (iterated local search), all within
    ``time_budget_s`` as ``clock`` (seconds) measures it. Never returns an order slower than the
    input order.
    """
    f, b = check_costs(fwd, bwd)
    m, p = f.shape
    c = comm_matrix(comm, m, p)
    if time_budget_s < 0:
        raise ValueError(f"time_budget_s must be >= 0, got {time_budget_s}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    # Enumerate only when it stays cheap: about m! * 2mp simulated ops.
    if m <= exhaustive_max and math.factorial(m) * m * p <= 4_000_000:
        return _exhaustive(f, b, c)
    deadline = clock() + time_budget_s
    starts = np.array([np.arange(m), paper_inter_order(f, b, c)], dtype=np.int64)
    spans = makespan_batch(f, b, starts, c)
    rng = np.random.default_rng(seed)
    k = int(np.argmin(spans))  # argmin keeps the input order on ties
    best, best_span = _local_search(f, b, c, starts[k], float(spans[k]), rng, batch, deadline, clock)
    for _ in range(restarts):
        if clock() >= deadline:
            break
        kicked = best.copy()
        for i, j in rng.integers(0, m, (2, 2)):
            kicked[i], kicked[j] = kicked[j], kicked[i]
        span = float(makespan_batch(f, b, kicked[None, :], c)[0])
        order, span = _local_search(f, b, c, kicked, span, rng, batch, deadline, clock)
        if span < best_span - _EPS * max(1.0, best_span):
            best, best_span = order, span
    return [int(i) for i in best]


def _exhaustive(f: np.ndarray, b: np.ndarray, c: np.ndarray) -> list[int]:
    m = f.shape[0]
    best, best_span = list(range(m)), math.inf
    perms = itertools.permutations(range(m))  # starts with the input order, so ties keep it
    while True:
        chunk = np.array(list(itertools.islice(perms, 4096)), dtype=np.int64)
        if len(chunk) == 0:
            return best
        spans = makespan_batch(f, b, chunk, c)
        k = int(np.argmin(spans))
        if best_span == math.inf or spans[k] < best_span - _EPS * max(1.0, best_span):
            best, best_span = [int(i) for i in chunk[k]], float(spans[k])

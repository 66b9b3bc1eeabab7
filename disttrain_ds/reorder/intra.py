"""Data reordering: balance samples across DP ranks and order microbatches for 1F1B.

* :func:`intra_microbatch_reorder` splits one microbatch's samples across ``dp_size`` ranks
  with equal sample counts, minimising the slowest rank (every rank of a stage waits for the
  slowest before the next pipeline stage can start).
* :func:`inter_microbatch_reorder` picks the execution order of a global batch's microbatches
  that minimises the simulated 1F1B makespan (:mod:`disttrain_ds.schedule.simulate`).

All functions are pure and deterministic for a given input (the local search is seeded; only
a time budget that runs out can make two calls differ).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from disttrain_ds.schedule.simulate import Comm, Costs2D, check_costs, comm_matrix, makespan_batch, stage_order

T = TypeVar("T")
_EPS = 1e-12


# --------------------------------------------------------------------------- ordering


def apply_order(items: Sequence[T], order: Sequence[int]) -> list[T]:
    """``items`` rearranged so that position ``j`` holds ``items[order[j]]``."""
    if sorted(order) != list(range(len(items))):
        raise ValueError(f"order must be a permutation of range({len(items)}), got {list(order)}")
    return [items[i] for i in order]


def _costs_1d(costs: Sequence[float]) -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1 or not np.isfinite(c).all() or (c < 0).any():
        raise ValueError("costs must be a 1-D sequence of finite values >= 0")
    return c


def _check_dp(n: int, dp_size: int) -> None:
    if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
    if n % dp_size:
        raise ValueError(f"dp_size ({dp_size}) must divide the number of samples ({n})")


# --------------------------------------------------------------------------- intra-microbatch


def lpt_rows(costs: np.ndarray, room: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Equal-count LPT on many independent rows at once (the one implementation of it).

    ``costs[b]`` (``[B, n]``) are row b's samples and ``room[b, r]`` (``[B, k]``) how many
    samples rank r of row b takes (0 pads a row with fewer ranks). Samples go heaviest first
    (stable) to the least-loaded rank that has room, ties to the lowest rank. Returns
    ``(rank[B, n], loads[B, k])``: each sample's rank and each rank's summed cost."""
    c = np.asarray(costs, dtype=np.float64)
    left = np.array(room, dtype=np.int64)
    b, k = left.shape
    order = np.argsort(-c, axis=1, kind="stable")
    heavy_first = np.take_along_axis(c, order, axis=1)
    loads = np.zeros(b * k)
    avail = np.where(left > 0, 0.0, np.inf).reshape(-1)  # loads of ranks with room, else inf
    left = left.reshape(-1)
    base = np.arange(b) * k
    placed = np.empty((b, c.shape[1]), dtype=np.int64)
    for t in range(c.shape[1]):  # t-th heaviest sample of every row
        r = np.argmin(avail.reshape(b, k), axis=1)  # first minimum: ties go to the lowest rank
        placed[:, t] = r
        f = base + r
        loads[f] += heavy_first[:, t]
        left[f] -= 1
        avail[f] = np.where(left[f] > 0, loads[f], np.inf)
    rank = np.empty_like(placed)
    np.put_along_axis(rank, order, placed, axis=1)
    return rank, loads.reshape(b, k)


def lpt_equal_count(costs: Sequence[float], dp_size: int) -> list[list[int]]:
    """Longest-processing-time-first restricted to ranks with room (equal sample counts)."""
    c = _costs_1d(costs)
    _check_dp(len(c), dp_size)
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    if len(c) == 0:
        return groups
    rank, _ = lpt_rows(c[None, :], np.full((1, dp_size), len(c) // dp_size))
    for i in np.argsort(-c, kind="stable"):  # members in the order they were placed
        groups[int(rank[0, i])].append(int(i))
    return groups


def balanced_differencing(costs: Sequence[float], dp_size: int) -> list[list[int]]:
    """Balanced largest differencing (Karmarkar-Karp for k ways with equal counts).

    Sorted samples are cut into tuples of ``dp_size``; each tuple is a partial partition with
    one sample per rank. The two partial partitions with the largest spread are merged by
    pairing the heaviest part of one with the lightest of the other, until one remains; every
    part receives exactly one sample per tuple, hence equal counts.
    """
    c = _costs_1d(costs)
    _check_dp(len(c), dp_size)
    order = np.argsort(-c, kind="stable")
    heap = []
    for t in range(len(c) // dp_size):
        idx = order[t * dp_size:(t + 1) * dp_size]
        parts = [(float(c[i]), [int(i)]) for i in idx]  # already heaviest first
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), t, parts))
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [ids for _, ids in heap[0][2]] if heap else [[] for _ in range(dp_size)]


def _swap_improve(c: np.ndarray, groups: list[list[int]], max_swaps: int) -> list[list[int]]:
    """Swap one sample of the heaviest rank with one of another rank while that lowers the
    larger of the two loads; counts never change."""
    members = [np.array(g, dtype=np.int64) for g in groups]
    loads = np.array([c[m].sum() for m in members])
    rank_of = np.empty(len(c), dtype=np.int64)
    for r, m in enumerate(members):
        rank_of[m] = r
    for _ in range(max_swaps):
        r = int(np.argmax(loads))
        mine = members[r]
        others = np.flatnonzero(rank_of != r)
        if len(mine) == 0 or len(others) == 0:
            break
        other_loads = loads[rank_of[others]]
        d = c[mine][:, None] - c[others][None, :]  # load moved from r to the other rank
        pair_max = np.maximum(loads[r] - d, other_loads[None, :] + d)
        pair_max[(d <= _EPS) | (pair_max >= loads[r] - _EPS * max(1.0, loads[r]))] = np.inf
        flat = int(np.argmin(pair_max))
        if not np.isfinite(pair_max.flat[flat]):
            break  # the heaviest rank cannot be lightened by a single swap
        a_pos, o_pos = divmod(flat, len(others))
        a, b = int(mine[a_pos]), int(others[o_pos])
        q = int(rank_of[b])
        members[r] = np.where(members[r] == a, b, members[r])
        members[q] = np.where(members[q] == b, a, members[q])
        rank_of[a], rank_of[b] = q, r
        loads[r] -= d[a_pos, o_pos]
        loads[q] += d[a_pos, o_pos]
    return [m.tolist() for m in members]


def _branch_and_bound(c: np.ndarray, dp_size: int, bound: float,
                      node_budget: int) -> list[list[int]] | None:
    """Depth-first search for an equal-count partition with max load below ``bound``; returns
    the best found (None if nothing beats ``bound`` within ``node_budget`` nodes)."""
    order = [int(i) for i in np.argsort(-c, kind="stable")]
    cap = len(c) // dp_size
    loads, groups = [0.0] * dp_size, [[] for _ in range(dp_size)]
    best: list[list[int]] | None = None
    nodes = 0

    def dfs(pos: int) -> None:
        nonlocal bound, best, nodes
        nodes += 1
        if nodes > node_budget:
            return
        if pos == len(order):
            bound, best = max(loads), [list(g) for g in groups]
            return
        i, seen = order[pos], set()
        for r in sorted(range(dp_size), key=lambda r: loads[r]):
            state = (loads[r], len(groups[r]))
            if len(groups[r]) == cap or state in seen:  # identical ranks: try one
                continue
            seen.add(state)
            if loads[r] + c[i] >= bound - _EPS * max(1.0, bound):
                continue
            loads[r] += c[i]
            groups[r].append(i)
            dfs(pos + 1)
            groups[r].pop()
            loads[r] -= c[i]

    dfs(0)
    return best


def _canonical(groups: list[list[int]]) -> list[list[int]]:
    """Ascending indices within a rank; ranks ordered by their smallest index (empty last)."""
    out = [sorted(g) for g in groups]
    return sorted(out, key=lambda g: (len(g) == 0, g[0] if g else 0))


def intra_microbatch_reorder(costs: Sequence[float], dp_size: int,
                             exact_max: int = 16) -> list[list[int]]:
    """Split samples across ``dp_size`` ranks, equal counts, minimising the largest rank sum.

    Runs equal-count LPT and balanced differencing, improves each by pairwise swaps with the
    heaviest rank, and keeps the better one (lower max load, then lower sum of squares). Up to
    ``exact_max`` samples, a bounded branch-and-bound then looks for a lower max load.
    Each rank's indices are ascending; ranks are ordered by their smallest index.
    """
    c = _costs_1d(costs)
    _check_dp(len(c), dp_size)
    if len(c) == 0:
        return [[] for _ in range(dp_size)]
    best, best_key = None, None
    for build in (lpt_equal_count, balanced_differencing):
        groups = _swap_improve(c, build(c, dp_size), max_swaps=4 * len(c))
        loads = [float(c[g].sum()) for g in groups]
        key = (max(loads), sum(x * x for x in loads))
        if best_key is None or key < best_key:
            best, best_key = groups, key
    if len(c) <= exact_max:  # small: search for a provably lower max load
        exact = _branch_and_bound(c, dp_size, best_key[0], node_budget=4_000)
        best = exact if exact is not None else best
    return _canonical(best)


def build_microbatches(costs: Sequence[float], dp_size: int,
                       num_microbatches: int) -> list[list[list[int]]]:
    """Cut a global batch into microbatches and balance each across DP ranks.

    Consecutive samples form a microbatch (the loader's grouping is kept); each microbatch is
    split by :func:`intra_microbatch_reorder`. Returns ``out[j][r]``: the sample indices of
    microbatch ``j`` on DP rank ``r``. Every index appears exactly once.
    """
    c = _costs_1d(costs)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, (int, np.integer)) \
            or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    _check_dp(len(c), dp_size)
    if len(c) % (dp_size * num_microbatches):
        raise ValueError(f"dp_size * num_microbatches ({dp_size * num_microbatches}) must divide "
                         f"the global batch ({len(c)})")
    size = len(c) // num_microbatches
    out = []
    for j in range(num_microbatches):
        lo = j * size
        groups = intra_microbatch_reorder(c[lo:lo + size], dp_size)
        out.append([[lo + i for i in g] for g in groups])
    return out


# --------------------------------------------------------------------------- inter-microbatch


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

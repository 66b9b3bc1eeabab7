"""Data reordering: balance samples across DP ranks and order microbatches for 1F1B.

* :func:`intra_microbatch_reorder` splits one microbatch's samples across ``dp_size`` ranks
  with equal sample counts, minimising the slowest rank (every rank of a stage waits for the
  slowest before the next pipeline stage can start).
* :func:`build_microbatches` cuts a batch into microbatches and splits each that way (the
  order they then run in: ``microbatch_order.py``).

All functions are pure and deterministic for a given input (the local search is seeded; only
a time budget that runs out can make two calls differ).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

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


def lpt_rows(costs: np.ndarray, room: np.ndarray, counted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Equal-count LPT on many independent rows at once (the one implementation of it).

    ``costs[b]`` (``[B, n]``) are row b's samples and ``room[b, r]`` (``[B, k]``) how many
    samples rank r of row b takes (0 pads a row with fewer ranks). Samples go heaviest first
    (stable) to the least-loaded rank that has room, ties to the lowest rank. ``counted``
    (bool ``[B, n]``, default all): False marks padding of a shorter row (cost 0, after the row's
    samples), which takes no room. Returns ``(rank[B, n], loads[B, k])``: each sample's rank and
    each rank's summed cost."""
    c = np.asarray(costs, dtype=np.float64)
    left = np.array(room, dtype=np.int64)
    b, k = left.shape
    order = np.argsort(-c, axis=1, kind="stable")
    # [n, B]: the t-th heaviest sample of every row, contiguous per t (the loop reads one t at a time)
    heavy = np.ascontiguousarray(np.take_along_axis(c, order, axis=1).T)
    takes = None if counted is None else np.ascontiguousarray(
        np.take_along_axis(np.asarray(counted, dtype=np.int64), order, axis=1).T)
    loads = np.zeros(b * k)
    avail = np.where(left > 0, 0.0, np.inf)  # [B, k] loads of ranks with room, else inf
    flat, left = avail.reshape(-1), left.reshape(-1)
    base = np.arange(b) * k
    placed = np.empty((c.shape[1], b), dtype=np.int64)
    for t in range(c.shape[1]):  # t-th heaviest sample of every row
        r = avail.argmin(axis=1)  # first minimum: ties go to the lowest rank
        placed[t] = r
        f = r + base
        new = loads[f] + heavy[t]
        loads[f] = new
        room_left = left[f] - (1 if takes is None else takes[t])
        left[f] = room_left
        flat[f] = np.where(room_left > 0, new, np.inf)
    rank = np.empty((b, c.shape[1]), dtype=np.int64)
    np.put_along_axis(rank, order, placed.T, axis=1)
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

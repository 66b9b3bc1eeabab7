"""1F1B makespans of stage DAGs, vectorised over microbatches and over many pipelines.

The same schedule as :func:`disttrain_ds.schedule.simulate.makespan_dag` (each stage's fixed
1F1B op order with ``min(depth, K)`` warm-up forwards; a forward waits for the same microbatch's
forward on every upstream stage, a backward for its backward on every downstream stage).

:func:`makespans` evaluates the op DAG in waves: an op's wave is the length of the longest
dependency chain before it, so the ops of one wave wait only for earlier waves and are computed
together, for all leading pipelines at once (the replica groups of ``planner/iteration_sim``, or
layouts that differ only in costs). The waves of a DAG and K are found once (cached) from the
schedule's end times at unit op cost, which come from relaxation sweeps (:func:`_sweep`): given the
arrival time of every op's cross-stage dependency, one stage's end times are a max-plus prefix
scan over its op order,

    end_j = C_j + max_{k <= j} (arrival_k - C_{k-1}),    C = cumulative op costs,

and sweeping the stages in data-flow order (forwards flow down) and back (backwards flow up) until
nothing changes reaches the schedule's times (a critical path that turns t times needs about t
sweeps, so with uneven op costs the waves, about 2K + the stage depth of them, are far fewer
Python steps). Sums are formed op by op, as the op-by-op simulators form them.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from disttrain_ds.schedule.simulate import FWD, Preds, _ops


@lru_cache(maxsize=256)
def _order(m: int, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """(is-forward mask, microbatch) of every op of a stage running ``warmup`` warm-up forwards."""
    ops = np.array(_ops(m, warmup), dtype=np.int64).reshape(-1, 2)
    return ops[:, 0] == FWD, ops[:, 1]


def _depths(preds: Preds) -> tuple[list[list[int]], list[int]]:
    succ: list[list[int]] = [[] for _ in preds]
    for s, ps in enumerate(preds):
        for u in ps:
            succ[u].append(s)
    depth = [0] * len(preds)
    for s in reversed(range(len(preds))):
        depth[s] = max((1 + depth[d] for d in succ[s]), default=0)
    return succ, depth


def _levels(preds: Preds, depth: list[int], k: int) -> list[np.ndarray]:
    """Stages grouped by (longest path from a source, warm-up depth), in increasing level: no
    stage of a group feeds another, and the group shares one op order, so its stages relax
    together exactly as one after another in data-flow order."""
    level = [0] * len(preds)
    for s, ps in enumerate(preds):
        level[s] = max((level[u] + 1 for u in ps), default=0)
    groups: dict[tuple[int, int], list[int]] = {}
    for s in range(len(preds)):
        groups.setdefault((level[s], min(depth[s], k)), []).append(s)
    return [np.array(groups[key], dtype=np.int64) for key in sorted(groups)]


def _padded(lists: list[list[int]], pad: int) -> np.ndarray:
    """``[n, longest]`` index matrix of ``lists``, short rows filled with ``pad``."""
    width = max((len(x) for x in lists), default=0) or 1
    return np.array([list(x) + [pad] * (width - len(x)) for x in lists], dtype=np.int64)


def _sweep(f: np.ndarray, b: np.ndarray, preds: Preds,
           passes: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """End times ``[..., P, K]`` of every forward and backward by relaxation sweeps (module
    docstring), stages of one level relaxed together; None if ``passes`` sweep pairs do not
    settle them."""
    k, p = f.shape[-2:]
    lead = f.shape[:-2]
    succ, depth = _depths(preds)
    # Column p is a stage that ends everything at 0: the padding of stages with fewer neighbours.
    end_f = np.zeros(lead + (p + 1, k))
    end_b = np.zeros(lead + (p + 1, k))
    groups = []
    for idx in _levels(preds, depth, k):
        is_f, mb = _order(k, min(depth[int(idx[0])], k))
        fs, bs = np.swapaxes(f[..., idx], -1, -2), np.swapaxes(b[..., idx], -1, -2)  # [..., n, K]
        cost = np.where(is_f, fs[..., mb], bs[..., mb])  # [..., n, ops]
        groups.append((idx, is_f, mb, cost, np.cumsum(cost, axis=-1),
                       _padded([list(preds[s]) for s in idx], p), _padded([succ[s] for s in idx], p)))

    def relax(group: tuple) -> bool:
        idx, is_f, mb, cost, total, up, down = group
        arr_f = end_f[..., up, :].max(axis=-2)  # [..., n, K]
        arr_b = end_b[..., down, :].max(axis=-2)
        arrival = np.where(is_f, arr_f[..., mb], arr_b[..., mb])
        end = total + np.maximum.accumulate(arrival - (total - cost), axis=-1)
        rows = idx[:, None]
        new_f, new_b = end[..., is_f], end[..., ~is_f]
        changed = not (np.array_equal(new_f, end_f[..., rows, mb[is_f]])
                       and np.array_equal(new_b, end_b[..., rows, mb[~is_f]]))
        end_f[..., rows, mb[is_f]] = new_f
        end_b[..., rows, mb[~is_f]] = new_b
        return changed

    changed, done = True, 0
    while changed:
        if passes is not None and done == passes:
            return None
        changed, done = False, done + 1
        for group in groups + groups[::-1]:
            changed |= relax(group)
    return end_f[..., :p, :], end_b[..., :p, :]


_WAVES: dict[tuple[Preds, int], tuple] = {}
_WAVES_KEPT = 256
QUICK_PASSES = 4
"""Sweep pairs tried before the op DAG's waves are built: even costs settle in two or three."""


def _waves(preds: Preds, k: int) -> tuple:
    """``_build_waves``, kept for the ``_WAVES_KEPT`` DAGs met last."""
    key = (preds, k)
    if key not in _WAVES:
        if len(_WAVES) >= _WAVES_KEPT:
            _WAVES.pop(next(iter(_WAVES)))
        _WAVES[key] = _build_waves(preds, k)
    return _WAVES[key]


def _build_waves(preds: Preds, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]]:
    """The op DAG of ``k`` microbatches over ``preds`` in waves of independent ops.

    Ops are built stage by stage in each stage's 1F1B order (op ``2k * s + j``); an op waits
    for the stage's previous op and for the same microbatch's forward on every upstream stage
    (a forward) or backward on every downstream stage (a backward). An op's wave is the length
    of the longest dependency chain before it (the schedule's end times at unit op cost), so no
    wave holds two ops where one waits for the other. Ops are then renumbered in wave order.
    Returns (stage, microbatch, is-forward of every op, and per wave (its ops: a slice, their
    previous ops, their dependencies: ``_trimmed``), index ``2k * P`` standing for "nothing")."""
    p = len(preds)
    succ, depth = _depths(preds)
    ones = np.ones((k, p))
    ends = _sweep(ones, ones, preds)
    assert ends is not None
    end_f, end_b = ends
    n = 2 * k * p
    stage = np.repeat(np.arange(p), 2 * k)
    is_f = np.concatenate([_order(k, min(depth[s], k))[0] for s in range(p)])
    mb = np.concatenate([_order(k, min(depth[s], k))[1] for s in range(p)])
    pos = np.zeros((2, p, k), dtype=np.int64)  # [backward?, stage, microbatch] -> op
    pos[(~is_f).astype(np.int64), stage, mb] = np.arange(n)
    level = np.where(is_f, end_f[stage, mb], end_b[stage, mb]).round().astype(np.int64)
    prev = np.where(np.arange(n) % (2 * k) == 0, n, np.arange(n) - 1)
    width = max((len(x) for x in (*preds, *succ)), default=0) or 1
    deps = np.full((n, width), n, dtype=np.int64)
    for s in range(p):
        ops = np.arange(2 * k * s, 2 * k * (s + 1))
        fwd, bwd = ops[is_f[ops]], ops[~is_f[ops]]
        for c, u in enumerate(preds[s]):
            deps[fwd, c] = pos[0, u, mb[fwd]]
        for c, d in enumerate(succ[s]):
            deps[bwd, c] = pos[1, d, mb[bwd]]
    # Ops renumbered wave by wave, so each wave's ops are one contiguous range (slices, no scatter).
    by = np.argsort(level, kind="stable")
    new = np.empty(n + 1, dtype=np.int64)
    new[by], new[n] = np.arange(n), n
    prev, deps = new[prev[by]], new[deps[by]]
    bounds = [0, *(np.flatnonzero(np.diff(level[by])) + 1), n]
    waves = tuple((slice(a, b), prev[a:b], _trimmed(deps[a:b], n)) for a, b in zip(bounds[:-1], bounds[1:]))
    return stage[by], mb[by], is_f[by], n, waves


def _trimmed(deps: np.ndarray, n: int) -> np.ndarray:
    """A wave's ``[ops, deg]`` dependencies without the columns that hold only "nothing" (``n``),
    and as ``[ops]`` where each op waits for at most one (most waves: a gather, no reduction)."""
    width = int((deps != n).sum(axis=1).max(initial=0))  # filled from the left
    return deps[:, 0] if width <= 1 else deps[:, :width]


def makespans(fwd: np.ndarray, bwd: np.ndarray, preds: Preds, quick: bool = True) -> np.ndarray:
    """Makespan of every pipeline in ``fwd`` / ``bwd`` (``[..., K, P]``, stage columns numbered
    topologically as ``preds``); returns the leading shape (a 0-d array for one pipeline).

    A few relaxation sweeps settle even costs; otherwise (or when the DAG's waves are at hand)
    the op DAG is evaluated wave by wave (``_waves``, built once per DAG and K): each wave's ops
    start at the later of their stage's previous op and their dependencies, all leading
    pipelines at once. ``quick=False`` skips the sweeps (uneven costs rarely settle in them)."""
    f = np.asarray(fwd, dtype=np.float64)
    b = np.asarray(bwd, dtype=np.float64)
    k, p = f.shape[-2:]
    if len(preds) != p:
        raise ValueError(f"preds must list {p} stages (fwd's columns), got {len(preds)}")
    preds = tuple(tuple(x) for x in preds)
    if quick and (preds, k) not in _WAVES:
        ends = _sweep(f, b, preds, QUICK_PASSES)
        if ends is not None:
            return np.maximum(ends[0].max(axis=(-2, -1)), ends[1].max(axis=(-2, -1)))
    stage, mb, is_f, n, waves = _waves(preds, k)
    cost = np.where(is_f, f[..., mb, stage], b[..., mb, stage])  # [..., ops]
    end = np.zeros(f.shape[:-2] + (n + 1,))
    for ops, prev, deps in waves:
        ready = end[..., deps] if deps.ndim == 1 else end[..., deps].max(axis=-1)
        end[..., ops] = np.maximum(end[..., prev], ready) + cost[..., ops]
    return end[..., :n].max(axis=-1)

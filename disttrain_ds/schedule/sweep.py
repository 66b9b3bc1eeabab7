"""1F1B makespans by relaxation sweeps, vectorised over microbatches and over many pipelines.

The same schedule as :func:`disttrain_ds.schedule.simulate.makespan_dag` (each stage's fixed
1F1B op order with ``min(depth, K)`` warm-up forwards; a forward waits for the same microbatch's
forward on every upstream stage, a backward for its backward on every downstream stage), computed
without a Python loop over ops: given the arrival time of every op's cross-stage dependency, one
stage's end times are a max-plus prefix scan over its op order,

    end_j = C_j + max_{k <= j} (arrival_k - C_{k-1}),    C = cumulative op costs,

one ``np.maximum.accumulate`` per stage. Sweeping the stages in data-flow order (forwards flow
down) and back (backwards flow up) until nothing changes reaches the schedule's times: they only
grow from 0 towards the unique solution of the DAG's equations, and each sweep pair carries every
dependency chain one turn further (a critical path turns a few times, so a few sweeps suffice).
Leading axes of the cost arrays are independent pipelines with the same stage DAG (the replica
groups of ``planner/iteration_sim``), all swept at once. Sums are formed in scan order, so a makespan can
differ from the op-by-op simulators in the last bits.
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


def makespans(fwd: np.ndarray, bwd: np.ndarray, preds: Preds) -> np.ndarray:
    """Makespan of every pipeline in ``fwd`` / ``bwd`` (``[..., K, P]``, stage columns numbered
    topologically as ``preds``); returns the leading shape (a 0-d array for one pipeline)."""
    f = np.asarray(fwd, dtype=np.float64)
    b = np.asarray(bwd, dtype=np.float64)
    k, p = f.shape[-2:]
    if len(preds) != p:
        raise ValueError(f"preds must list {p} stages (fwd's columns), got {len(preds)}")
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

    changed = True
    while changed:
        changed = False
        for group in groups + groups[::-1]:
            changed |= relax(group)
    return np.maximum(end_f[..., :p, :].max(axis=(-2, -1)), end_b[..., :p, :].max(axis=(-2, -1)))

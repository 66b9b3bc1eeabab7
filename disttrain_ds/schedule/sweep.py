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
    end_f = np.zeros(lead + (p, k))
    end_b = np.zeros(lead + (p, k))
    zero = np.zeros(lead + (k,))
    orders = [_order(k, min(depth[s], k)) for s in range(p)]
    costs = []
    for s in range(p):
        is_f, mb = orders[s]
        costs.append(np.where(is_f, f[..., mb, s], b[..., mb, s]))
    starts = [np.cumsum(c, axis=-1) for c in costs]

    def relax(s: int) -> bool:
        is_f, mb = orders[s]
        arr_f = np.max([end_f[..., u, :] for u in preds[s]], axis=0) if preds[s] else zero
        arr_b = np.max([end_b[..., d, :] for d in succ[s]], axis=0) if succ[s] else zero
        arrival = np.where(is_f, arr_f[..., mb], arr_b[..., mb])
        total = starts[s]
        end = total + np.maximum.accumulate(arrival - (total - costs[s]), axis=-1)
        new_f, new_b = end[..., is_f], end[..., ~is_f]
        changed = not (np.array_equal(new_f, end_f[..., s, mb[is_f]])
                       and np.array_equal(new_b, end_b[..., s, mb[~is_f]]))
        end_f[..., s, mb[is_f]] = new_f
        end_b[..., s, mb[~is_f]] = new_b
        return changed

    changed = True
    while changed:
        changed = False
        for s in list(range(p)) + list(reversed(range(p))):
            changed |= relax(s)
    return np.maximum(end_f.max(axis=(-2, -1)), end_b.max(axis=(-2, -1)))

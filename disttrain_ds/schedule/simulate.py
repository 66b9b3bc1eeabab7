"""Event simulation of one training iteration under non-interleaved 1F1B.

The pipeline is a chain of stages (stage 0 = first encoder stage ... last = last generator
stage). Stage ``s`` of ``p`` runs ``w = min(p - s - 1, m)`` warm-up forwards, then ``m - w``
steady (forward, backward) pairs, then ``w`` cool-down backwards -- the order DeepSpeed's
``TrainSchedule`` and Megatron-LM's ``forward_backward_pipelining_without_interleaving``
run. An op starts once its stage is free and its dependency has arrived:

* forward of microbatch ``i`` on stage ``s`` needs forward ``i`` on ``s - 1`` plus the
  boundary's communication time;
* backward of ``i`` on ``s`` needs backward ``i`` on ``s + 1`` plus communication (on the
  last stage it follows its own forward, which the stage order already guarantees).

Costs are given per execution slot: ``fwd[i][s]`` is the forward time of the ``i``-th
microbatch to run on stage ``s``. Data-parallel fan-in/out or repeated stages are expressed by
the caller through these arrays. Time units are whatever the caller uses (ms, s, FLOPs).

A module graph (:class:`~disttrain_ds.graph.ModuleGraph`) with parallel encoders or generators
is not a chain: :func:`graph_stages` numbers the stages of all modules (data-flow order, each
module's stages consecutive) and lists each stage's upstream stages, and :func:`simulate_dag` /
:func:`makespan_dag` run 1F1B over that DAG. A forward waits for the same microbatch's forward
on *every* upstream stage (the LLM's first stage for every encoder), a backward for its backward
on every downstream stage, and a stage runs ``min(d, m)`` warm-up forwards where ``d`` is the
longest run of stages after it (``p - s - 1`` on a chain, so a chain gives the chain's result).
Encoders thus run concurrently before the LLM and generators concurrently after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from disttrain_ds.graph import ModuleGraph

FWD, BWD = 0, 1
Costs2D = Sequence[Sequence[float]] | np.ndarray
"""``[microbatches][stages]`` times."""
Comm = float | Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None
"""Communication time: None, a scalar, ``[stages - 1]`` or ``[microbatches][stages - 1]``."""
Preds = tuple[tuple[int, ...], ...]
"""Upstream stages of every stage; stages are numbered so that each comes after its upstreams."""
_KIND_NAMES = ("fwd", "bwd")


class Event(NamedTuple):
    """One forward or backward op in a simulated timeline (a tuple: cheap to build in bulk)."""

    stage: int
    """Pipeline stage index (0 = first)."""
    microbatch: int
    """Execution slot of the microbatch (0 = first to enter the pipeline)."""
    kind: str
    """``"fwd"`` or ``"bwd"``."""
    start: float
    """Start time, in the cost arrays' unit."""
    end: float
    """End time, in the cost arrays' unit."""

    def to_dict(self) -> dict:
        """The event-dict shape :mod:`disttrain_ds.schedule.timeline` reads."""
        return {"name": self.kind, "stage": self.stage, "microbatch": self.microbatch,
                "start": self.start, "end": self.end}


@dataclass(frozen=True)
class SimResult:
    """Outcome of simulating one iteration."""

    makespan: float
    """Time from the first op's start (0) to the last op's end."""
    events: tuple[Event, ...]
    """Every op, in a valid execution (topological) order."""

    def busy(self) -> list[float]:
        """Total compute time of each stage."""
        out = [0.0] * (1 + max((e.stage for e in self.events), default=-1))
        for e in self.events:
            out[e.stage] += e.end - e.start
        return out

    def bubble_fraction(self) -> float:
        """Idle share of all stage-time within the makespan (0 = no bubbles)."""
        busy = self.busy()
        if not busy or self.makespan <= 0:
            return 0.0
        return 1.0 - sum(busy) / (len(busy) * self.makespan)


def stage_order(num_microbatches: int, num_stages: int, stage: int) -> list[tuple[int, int]]:
    """The fixed 1F1B op order of one stage as ``(kind, microbatch)``, kind FWD=0 / BWD=1."""
    m, p = num_microbatches, num_stages
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in [0, {p}), got {stage}")
    return _ops(m, min(p - stage - 1, m))


def _ops(m: int, warmup: int) -> list[tuple[int, int]]:
    """``warmup`` forwards, then (forward, backward) pairs, then the remaining backwards."""
    ops = [(FWD, i) for i in range(warmup)]
    for k in range(m - warmup):
        ops.append((FWD, warmup + k))
        ops.append((BWD, k))
    ops.extend((BWD, k) for k in range(m - warmup, m))
    return ops


@dataclass(frozen=True)
class _Plan:
    """Cost-independent structure of a 1F1B iteration, built once per (m, p)."""

    stage: np.ndarray  # per op, in topological order
    kind: np.ndarray
    mb: np.ndarray
    prev: np.ndarray  # same-stage predecessor op, or the sentinel index n_ops
    dep: np.ndarray  # cross-stage dependency op, or the sentinel
    boundary: np.ndarray  # pipeline boundary crossed by dep (comm index), or -1
    levels: tuple[np.ndarray, ...]  # ops grouped so each group depends only on earlier groups
    rows: tuple[tuple[int, int, int, int, int, int], ...]  # plain-Python copy for the fast loop


@lru_cache(maxsize=64)
def _plan(m: int, p: int) -> _Plan:
    orders = [stage_order(m, p, s) for s in range(p)]
    done = [0] * p  # ops of each stage already placed in the topological order
    index: dict[tuple[int, int, int], int] = {}
    rows: list[list[int]] = []
    total = 2 * m * p
    while len(rows) < total:
        progressed = False
        for s in range(p):
            while done[s] < len(orders[s]):
                kind, i = orders[s][done[s]]
                if kind == FWD and s > 0:
                    dep_key, boundary = (s - 1, FWD, i), s - 1
                elif kind == BWD and s < p - 1:
                    dep_key, boundary = (s + 1, BWD, i), s
                else:
                    dep_key, boundary = None, -1
                if dep_key is not None and dep_key not in index:
                    break
                prev = index[(s,) + orders[s][done[s] - 1]] if done[s] else -1
                dep = index[dep_key] if dep_key is not None else -1
                index[(s, kind, i)] = len(rows)
                rows.append([s, kind, i, prev, dep, boundary])
                done[s] += 1
                progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order; guards against edits
            raise RuntimeError("1F1B dependency cycle")
    arr = np.array(rows, dtype=np.int64).reshape(-1, 6)
    n = len(rows)
    prev = np.where(arr[:, 3] < 0, n, arr[:, 3])
    dep = np.where(arr[:, 4] < 0, n, arr[:, 4])
    level = np.zeros(n + 1, dtype=np.int64)
    for o in range(n):  # topological order: predecessors already have their level
        level[o] = 1 + max(level[prev[o]], level[dep[o]])
    level = level[:n]
    by_level = np.argsort(level, kind="stable")
    cuts = np.flatnonzero(np.diff(level[by_level])) + 1
    fast_rows = tuple((int(r[0]), int(r[1]), int(r[2]), int(pv), int(dp), int(r[5]))
                      for r, pv, dp in zip(arr, prev, dep))
    return _Plan(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), prev, dep,
                 arr[:, 5].copy(), tuple(np.split(by_level, cuts)), fast_rows)


def check_costs(fwd: Costs2D, bwd: Costs2D) -> tuple[np.ndarray, np.ndarray]:
    """``fwd`` and ``bwd`` as float arrays of the same non-empty 2-D shape, finite, >= 0."""
    f = np.asarray(fwd, dtype=np.float64)
    b = np.asarray(bwd, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] == 0 or f.shape[1] == 0:
        raise ValueError(f"fwd must be a non-empty [microbatches][stages] array, got {f.shape}")
    if b.shape != f.shape:
        raise ValueError(f"bwd must have fwd's shape {f.shape}, got {b.shape}")
    if (f < 0).any() or (b < 0).any() or not (np.isfinite(f).all() and np.isfinite(b).all()):
        raise ValueError("fwd and bwd must be finite and >= 0")
    return f, b


def comm_matrix(comm: Comm, m: int, p: int) -> np.ndarray:
    """Broadcast ``comm`` to ``[m, p - 1]``: None -> zeros, a scalar -> every boundary,
    ``[p - 1]`` -> per boundary, ``[m, p - 1]`` -> per microbatch and boundary. The same time
    is charged to the activation (forward) and its gradient (backward)."""
    if comm is None:
        return np.zeros((m, max(p - 1, 0)))
    c = np.asarray(comm, dtype=np.float64)
    if c.ndim == 0:
        c = np.full((m, max(p - 1, 0)), float(c))
    elif c.ndim == 1 and c.shape[0] == p - 1:
        c = np.broadcast_to(c, (m, p - 1)).copy()
    elif c.shape != (m, p - 1):
        raise ValueError(f"comm must be a scalar, [{p - 1}] or [{m}, {p - 1}], got shape {c.shape}")
    if (c < 0).any() or not np.isfinite(c).all():
        raise ValueError("comm must be finite and >= 0")
    return c


def _op_costs(plan: _Plan, f: np.ndarray, b: np.ndarray, c: np.ndarray) -> tuple[list, list]:
    cost = np.where(plan.kind == FWD, f[plan.mb, plan.stage], b[plan.mb, plan.stage])
    if c.shape[1]:
        comm = np.where(plan.boundary >= 0, c[plan.mb, np.maximum(plan.boundary, 0)], 0.0)
    else:
        comm = np.zeros_like(cost)
    return cost.tolist(), comm.tolist()


def simulate_1f1b(fwd: Costs2D, bwd: Costs2D, comm: Comm = None) -> SimResult:
    """Simulate one 1F1B iteration; ``fwd[i][s]``/``bwd[i][s]`` are per execution slot."""
    f, b = check_costs(fwd, bwd)
    m, p = f.shape
    plan = _plan(m, p)
    cost, comm_t = _op_costs(plan, f, b, comm_matrix(comm, m, p))
    end = [0.0] * (len(cost) + 1)  # last slot is the sentinel "no dependency" at t = 0
    events = []
    for o, (s, kind, i, prev, dep, _) in enumerate(plan.rows):
        start = max(end[prev], end[dep] + comm_t[o])
        end[o] = start + cost[o]
        events.append(Event(s, i, _KIND_NAMES[kind], start, end[o]))
    return SimResult(max(end), tuple(events))


def makespan_1f1b(fwd: Costs2D, bwd: Costs2D, comm: Comm = None) -> float:
    """Makespan only (no timeline), same semantics as :func:`simulate_1f1b`."""
    f, b = check_costs(fwd, bwd)
    m, p = f.shape
    plan = _plan(m, p)
    cost, comm_t = _op_costs(plan, f, b, comm_matrix(comm, m, p))
    end = [0.0] * (len(cost) + 1)
    for o, row in enumerate(plan.rows):
        a, d = end[row[3]], end[row[4]] + comm_t[o]
        end[o] = (a if a > d else d) + cost[o]
    return max(end)


def makespan_batch(fwd: Costs2D, bwd: Costs2D, orders: np.ndarray, comm: Comm = None) -> np.ndarray:
    """Makespans of many execution orders at once (vectorised over candidates).

    ``orders`` is ``[k, m]``: row ``r`` runs microbatch ``orders[r][j]`` in slot ``j``;
    ``fwd``/``bwd``/``comm`` are indexed by microbatch (input order). Returns ``[k]``.
    """
    f, b = check_costs(fwd, bwd)
    m, p = f.shape
    orders = np.asarray(orders, dtype=np.int64)
    if orders.ndim != 2 or orders.shape[1] != m:
        raise ValueError(f"orders must have shape [k, {m}], got {orders.shape}")
    c = comm_matrix(comm, m, p)
    plan = _plan(m, p)
    who = np.ascontiguousarray(orders.T)[plan.mb]  # [ops, k]: candidates contiguous per op
    table = np.stack([f, b], axis=2).ravel()  # [m, p, kind] flattened
    cost = table.take(who * (2 * p) + (2 * plan.stage + plan.kind)[:, None])
    if c.shape[1] == 0 or not c.any():
        comm_t = np.zeros((cost.shape[0], 1))
    elif (c == c[:1]).all():  # same for every microbatch: independent of the order
        comm_t = np.where(plan.boundary >= 0, c[0][np.maximum(plan.boundary, 0)], 0.0)[:, None]
    else:
        bnd = plan.boundary[:, None]
        comm_t = np.where(bnd >= 0, c.ravel().take(who * (p - 1) + np.maximum(bnd, 0)), 0.0)
    end = np.zeros((cost.shape[0] + 1, orders.shape[0]))
    for ops in plan.levels:  # ops within a level are independent of each other
        end[ops] = np.maximum(end[plan.prev[ops]], end[plan.dep[ops]] + comm_t[ops]) + cost[ops]
    return end.max(axis=0)


# --------------------------------------------------------------------------- module graphs


def chain_preds(num_stages: int) -> Preds:
    """The upstream stages of a plain pipeline of ``num_stages`` stages."""
    return tuple(() if s == 0 else (s - 1,) for s in range(num_stages))


def graph_stages(graph: ModuleGraph, pp: Mapping[str, int]) -> tuple[dict[str, range], Preds]:
    """Stage numbers of every module (modules in data-flow order, each one's ``pp[name]`` stages
    consecutive) and every stage's upstream stages: a module's stages form a chain, every
    encoder's last stage feeds the LLM's first, the LLM's last feeds every generator's first.
    The three-module graph gives the plain chain encoder -> LLM -> generator."""
    ranges, start = {}, 0
    for n in graph.names:
        ranges[n] = range(start, start + pp[n])
        start += pp[n]
    preds: list[tuple[int, ...]] = [()] * start
    for n in graph.names:
        r = ranges[n]
        preds[r.start] = tuple(ranges[u][-1] for u in graph.upstream(n))
        for s in r[1:]:
            preds[s] = (s - 1,)
    return ranges, tuple(preds)


def is_chain(preds: Preds) -> bool:
    """Whether ``preds`` is a plain pipeline (each stage fed by the one before)."""
    return preds == chain_preds(len(preds))


def makespan_graph(fwd: Costs2D, bwd: Costs2D, graph: ModuleGraph, pp: Mapping[str, int]) -> float:
    """1F1B makespan over a module graph's stages (:func:`graph_stages` columns): the chain
    simulator when the graph's stages form a chain, the DAG's otherwise."""
    _, preds = graph_stages(graph, pp)
    return makespan_1f1b(fwd, bwd) if is_chain(preds) else makespan_dag(fwd, bwd, preds)


def longest_path_view(stages: np.ndarray, graph: ModuleGraph, pp: Mapping[str, int]) -> np.ndarray:
    """``[K, P]`` times in :func:`graph_stages` columns -> the chain of the graph's longest path
    (``ModuleGraph.stage_offsets``), each position the slowest of the parallel stages there:
    what a chain-only search (inter-microbatch reordering) can see of a stage DAG."""
    offsets, length = graph.stage_offsets(pp)
    cols = np.concatenate([offsets[n] + np.arange(pp[n]) for n in graph.names])
    out = np.zeros((len(stages), length))
    np.maximum.at(out.T, cols, np.asarray(stages, dtype=np.float64).T)
    return out


def dag_edges(preds: Preds) -> tuple[tuple[int, int], ...]:
    """(upstream, stage) boundaries in stage order: the index a per-boundary comm time uses."""
    return tuple((u, s) for s, ps in enumerate(preds) for u in ps)


@lru_cache(maxsize=64)
def _dag_rows(m: int, preds: Preds) -> tuple[tuple, ...]:
    """(stage, kind, microbatch, same-stage predecessor, ((dependency, boundary), ...)) per op,
    in a topological order; -1 (the sentinel) when there is no predecessor."""
    p = len(preds)
    for s, ps in enumerate(preds):
        if len(set(ps)) != len(ps) or any(not 0 <= u < s for u in ps):
            raise ValueError(f"preds[{s}] must list distinct earlier stages, got {ps}")
    succ: list[list[int]] = [[] for _ in range(p)]
    for s, ps in enumerate(preds):
        for u in ps:
            succ[u].append(s)
    depth = [0] * p  # stages on the longest path after s: its 1F1B warm-up count
    for s in reversed(range(p)):
        depth[s] = max((1 + depth[d] for d in succ[s]), default=0)
    edge = {e: k for k, e in enumerate(dag_edges(preds))}
    orders = [_ops(m, min(depth[s], m)) for s in range(p)]
    done, index, rows = [0] * p, {}, []
    while len(rows) < 2 * m * p:
        progressed = False
        for s in range(p):
            while done[s] < len(orders[s]):
                kind, i = orders[s][done[s]]
                deps = [((u, FWD, i), edge[(u, s)]) for u in preds[s]] if kind == FWD else \
                    [((d, BWD, i), edge[(s, d)]) for d in succ[s]]
                if any(key not in index for key, _ in deps):
                    break
                prev = index[(s,) + orders[s][done[s] - 1]] if done[s] else -1
                index[(s, kind, i)] = len(rows)
                rows.append((s, kind, i, prev, tuple((index[key], e) for key, e in deps)))
                done[s] += 1
                progressed = True
        if not progressed:  # cannot happen for these orders; guards against edits
            raise RuntimeError("1F1B dependency cycle")
    return tuple(rows)


def _dag_run(fwd: Costs2D, bwd: Costs2D, preds: Preds, comm: float | Sequence[float] | None,
             keep_events: bool) -> SimResult:
    f, b = check_costs(fwd, bwd)
    m, p = f.shape
    preds = tuple(tuple(int(u) for u in ps) for ps in preds)
    if len(preds) != p:
        raise ValueError(f"preds must list {p} stages (fwd's columns), got {len(preds)}")
    n_edges = len(dag_edges(preds))
    c = np.zeros(n_edges) if comm is None else np.broadcast_to(np.asarray(comm, dtype=np.float64),
                                                                (n_edges,))
    if (c < 0).any() or not np.isfinite(c).all():
        raise ValueError(f"comm must be None, a scalar or [{n_edges}] finite times >= 0")
    cost, comm_t = (f.tolist(), b.tolist()), c.tolist()
    rows = _dag_rows(m, preds)
    end = [0.0] * (len(rows) + 1)  # last slot: the sentinel "no predecessor" at t = 0
    events = []
    for o, (s, kind, i, prev, deps) in enumerate(rows):
        start = end[prev]
        for dep, e in deps:
            t = end[dep] + comm_t[e]
            if t > start:
                start = t
        end[o] = start + cost[kind][i][s]
        if keep_events:
            events.append(Event(s, i, _KIND_NAMES[kind], start, end[o]))
    return SimResult(max(end), tuple(events))


def simulate_dag(fwd: Costs2D, bwd: Costs2D, preds: Preds,
                 comm: float | Sequence[float] | None = None) -> SimResult:
    """Simulate one 1F1B iteration over the stage DAG ``preds`` (see the module docstring);
    ``comm``: None, a scalar or one time per boundary of :func:`dag_edges`. On a chain the
    events and makespan equal :func:`simulate_1f1b`'s."""
    return _dag_run(fwd, bwd, preds, comm, keep_events=True)


def makespan_dag(fwd: Costs2D, bwd: Costs2D, preds: Preds,
                 comm: float | Sequence[float] | None = None) -> float:
    """Makespan only (no timeline), same semantics as :func:`simulate_dag`."""
    return _dag_run(fwd, bwd, preds, comm, keep_events=False).makespan

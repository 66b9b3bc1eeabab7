"""Simulated training iterations of a plan on drawn samples, as the runtime runs them.

Per-sample module times (:func:`sample_times`) fill pipeline steps of D = DP_llm x M samples in
loader order; within a step, replica r of a module with DP = dp takes the r-th contiguous block of
D / dp samples (``comm.routes.blocks``), and a stage's time is its replica's load / PP (layers
split evenly), forward : backward = 1 : ``pipeline.BACKWARD_FACTOR``.

**Replicas as the runtime couples them.** Each module's DP replicas are separate pipelines of
DeepSpeed stages (stage-to-stage sends stay inside one replica); modules meet only at their
boundaries, where the inter-engine communicator moves each sample from the upstream replica that
owns it to the downstream one (``comm.routes``: per boundary, ``gcd(dp_up, dp_down)`` broker
groups), once per microbatch in each direction; the DP replicas of a module meet again only at
the gradient all-reduce after the last microbatch. So the replicas split into
``gcd(dp of every module)`` groups that never wait for each other within an iteration
(:func:`replica_groups`), and inside a group a replica waits only for the replicas it exchanges
samples with. :func:`simulate_iteration` runs each group's 1F1B over its replica-stage DAG
(``sweep.makespans``, all groups at once; every replica-stage keeps its module stage's
``TrainSchedule`` order) and takes the slowest group: a replica slow in one microbatch and fast in the next evens
out unless a boundary partner makes it wait. ``lock_step=True`` gives the coarser model in which
every stage waits for its slowest replica at every microbatch (an upper bound, kept for
comparison).

Per-module post-balancing (``PostBalance``, the runtime's ``parallel.post_balance``): every module
but the LLM splits each step over its replicas by LPT with room (``reorder.post_balance.share_cap``;
the runtime's assignment improves on it by moves and swaps, so its loads are at most these), of its
units where ``PostBalance.units`` gives them (an encoder's images, a generator's target images:
each sample's share of its time), else of whole samples; any replica of such a module may then
exchange units with any LLM replica, so the replicas form one group in which those modules' replicas
wait for every LLM replica (an upper bound on the runtime's per-microbatch links).

Adaptive SP groups (``auto``, ``sp: auto``): such a module's replicas regroup every step by its
samples' costs (``planner/sp_auto.py``, the runtime's group search), each replica taking its
group's time; they too form one group with every partner.

Reordering: intra (:func:`balance_steps`) balances each step's replicas with
``intra_microbatch_reorder``; inter reorders the steps with ``inter_microbatch_reorder`` on the
lock-step stage times. Either is kept only when the simulated iteration does not get longer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, reduce

import numpy as np

from disttrain_ds.comm.routes import routes
from disttrain_ds.planner.pipeline import split_fwd_bwd
from disttrain_ds.planner.plan import Plan
from disttrain_ds.planner.sp_auto import step_loads
from disttrain_ds.reorder.intra import intra_microbatch_reorder, lpt_rows
from disttrain_ds.reorder.microbatch_order import inter_microbatch_reorder
from disttrain_ds.reorder.post_balance import flat_units, share_cap, unit_rows
from disttrain_ds.reorder.sp_groups import SPCost
from disttrain_ds.schedule.simulate import Preds, graph_stages, is_chain, longest_path_view, makespan_1f1b, makespan_dag
from disttrain_ds.schedule.sweep import makespans

Auto = Mapping[str, SPCost] | None
"""Modules at adaptive SP groups -> the cost their groups are chosen by (``sp_auto.draw_cost``)."""

VARIANTS: dict[str, tuple[bool, bool]] = {"none": (False, False), "intra": (True, False),
                                           "inter": (False, True), "both": (True, True)}
"""Reordering variants: name -> (intra-microbatch, inter-microbatch)."""


@dataclass(frozen=True)
class PostBalance:
    """Per-module post-balancing in the simulation (module docstring)."""

    share: float = 2.0
    """The runtime's ``parallel.post_balance_share``: at most this many times the even share per replica."""
    units: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Module name -> ``reorder.post_balance.flat_units`` of its units' shares of each sample's time
    (samples as the rows of ``times``; a sample's shares sum to 1, none where it has no work there);
    a module not named splits whole samples."""

    def __post_init__(self) -> None:
        if not self.share >= 1:
            raise ValueError(f"share must be >= 1 (a multiple of the even share), got {self.share}")

    @staticmethod
    def of(shares: dict[str, Sequence[Sequence[float]]], share: float = 2.0) -> "PostBalance":
        """From each module's per-sample lists of unit shares."""
        return PostBalance(share, {n: flat_units(u) for n, u in shares.items()})


@dataclass(frozen=True)
class IterationSim:
    """One simulated 1F1B iteration."""

    makespan_ms: float
    """Simulated iteration time."""
    stage_ms: np.ndarray
    """``[K, P]`` fwd+bwd time of each step on each pipeline stage at its slowest replica's
    load (the lock-step view), in execution order."""
    arrangement: np.ndarray
    """Sample index (into the iteration's samples) of every slot; step j holds slots
    ``j*D .. (j+1)*D - 1``, replica r of a module the r-th contiguous chunk of them."""
    order: tuple[int, ...]
    """Execution order of the steps (indices of the arrangement's steps)."""


def sample_times(flops: np.ndarray, plan_: Plan) -> np.ndarray:
    """``[n, modules]`` per-sample fwd+bwd ms of each module under ``plan_`` (columns in the
    plan's module order, as ``flops``'): the FLOPs rescaled so each column's mean is the plan's
    per-sample mean cost (warm-up term / samples per replica / the straggler factor priced into
    it), i.e. time proportional to FLOPs within
    a module, at the profile's efficiency."""
    f = np.asarray(flops, dtype=np.float64)
    per = np.array([m.warmup_ms / m.samples_per_microbatch / m.straggler
                    for m in plan_.modules.values()])
    mean = f.mean(axis=0)
    return np.where(mean > 0, f / np.where(mean > 0, mean, 1.0), 1.0) * per


def _step_size(plan_: Plan) -> int:
    return plan_.llm.dp * plan_.llm.samples_per_microbatch


def replica_max(steps: np.ndarray, plan_: Plan) -> np.ndarray:
    """``[K, modules]`` slowest replica's load per module for ``steps`` = ``[K, D, modules]`` ms,
    where replica r of a module with DP = dp takes slots ``r*D/dp .. (r+1)*D/dp - 1``."""
    k, d, _ = steps.shape
    return np.stack([steps[:, :, j].reshape(k, m.dp, -1).sum(axis=2).max(axis=1)
                     for j, m in enumerate(plan_.modules.values())], axis=1)


def replica_loads(times: np.ndarray, plan_: Plan, arrangement: np.ndarray,
                  post: PostBalance | None = None, auto: Auto = None) -> list[np.ndarray]:
    """Per module (plan order), ``[K, dp]`` replica loads of every step: contiguous blocks of the
    arrangement, or with ``post`` every module but the LLM split by LPT with room, or for a module
    of ``auto`` each replica its adaptive SP group's time (module docstring)."""
    d = _step_size(plan_)
    idx = np.asarray(arrangement).reshape(-1, d)
    out = []
    for j, (name, m) in enumerate(plan_.modules.items()):
        col = np.asarray(times, dtype=np.float64)[:, j]
        if auto and name in auto:  # samples in units of the plan's mean sample, groups as the runtime forms them
            key = (name, idx.tobytes())
            memo = auto.loads if isinstance(auto, _Frozen) else {}
            if key not in memo:
                unit = m.warmup_ms / m.samples_per_microbatch / m.straggler
                memo[key] = np.stack([step_loads(col[row] / unit, m.dp, auto[name], name == plan_.graph.llm) * unit
                                      for row in idx])
            out.append(memo[key])
            continue
        if post is None or name == plan_.graph.llm or m.dp == 1:
            out.append(col[idx].reshape(len(idx), m.dp, -1).sum(axis=2))
            continue
        flat = post.units.get(name)
        if flat is None:
            costs, real = col[idx], np.ones(idx.shape, dtype=bool)
        else:
            costs, real = unit_rows(*flat, idx, scale=col)
        cap = [share_cap(int(t), m.dp, post.share) for t in real.sum(axis=1)]
        room = np.repeat(np.array(cap)[:, None], m.dp, axis=1)
        out.append(lpt_rows(costs, room, real)[1])
    return out


def _stages(loads: np.ndarray, plan_: Plan) -> np.ndarray:
    """``[K, modules]`` loads per step -> ``[K, P]`` stage times (load / PP on each stage), in
    ``simulate.graph_stages`` numbering."""
    return np.concatenate([np.repeat(loads[:, [j]] / m.pp, m.pp, axis=1)
                           for j, m in enumerate(plan_.modules.values())], axis=1)


def _pp(plan_: Plan) -> dict[str, int]:
    return {n: m.pp for n, m in plan_.modules.items()}


def stage_times(times: np.ndarray, plan_: Plan, arrangement: np.ndarray, post: PostBalance | None = None,
                auto: Auto = None) -> np.ndarray:
    """``[K, P]`` fwd+bwd time per step and pipeline stage (each module's stages in the plan's
    data-flow order): a module's slowest replica load split evenly over its PP stages."""
    loads = replica_loads(times, plan_, arrangement, post, auto)
    return _stages(np.stack([x.max(axis=1) for x in loads], axis=1), plan_)


def balance_step(step: np.ndarray, plan_: Plan) -> np.ndarray:
    """Slot order of one step's ``[D, modules]`` sample times that balances module replicas.

    Modules are taken by replica size D/DP, smallest first (size 1 needs nothing): the current
    units (single samples, then the previous level's replicas) are grouped into this level's
    replicas by ``intra_microbatch_reorder`` on their stage-time contribution (load / PP, summed
    over modules of the same size), so finer replicas stay intact inside coarser ones. When a
    size is not a multiple of the previous one, chunks stop nesting and coarser modules keep
    contiguous chunks of the finer level's order."""
    d = len(step)
    sizes: dict[int, np.ndarray] = {}
    for j, mod in enumerate(plan_.modules.values()):
        m = d // mod.dp
        if m > 1:
            sizes[m] = sizes.get(m, 0.0) + step[:, j] / mod.pp
    units, prev = [[i] for i in range(d)], 1
    for m in sorted(sizes):
        if m % prev:
            break
        weight = [float(sizes[m][u].sum()) for u in units]
        groups = intra_microbatch_reorder(weight, d // m)
        units, prev = [[i for g in grp for i in units[g]] for grp in groups], m
    return np.array([i for u in units for i in u], dtype=np.int64)


def balance_steps(times: np.ndarray, plan_: Plan) -> np.ndarray:
    """Intra-microbatch reordering of a whole iteration: each step's slots reordered by
    :func:`balance_step`, kept only if no module's slowest replica gets slower (so stage times
    never grow, and the 1F1B makespan, monotone in op times, never does either)."""
    d = _step_size(plan_)
    out = np.arange(len(times))
    for lo in range(0, len(times), d):
        step = times[lo:lo + d]
        perm = balance_step(step, plan_)
        before, after = replica_max(np.stack([step, step[perm]]), plan_)
        if (after <= before).all():
            out[lo:lo + d] = lo + perm
    return out


def replica_groups(plan_: Plan, post: PostBalance | None = None, auto: Auto = None) -> int:
    """Groups of replicas that never wait for each other within an iteration: the gcd of every
    module's DP. Across one boundary the communicator's broker groups number
    ``gcd(dp_up, dp_down)`` (``comm.routes.broker_groups``); along the graph they join. With
    post-balancing or adaptive SP groups every replica may exchange with every partner: one group."""
    return 1 if post is not None or auto else reduce(math.gcd, (m.dp for m in plan_.modules.values()))


@lru_cache(maxsize=64)
def _group_preds(names: tuple[str, ...], upstream: tuple[tuple[str, ...], ...],
                 replicas: tuple[int, ...], pps: tuple[int, ...], samples: int,
                 linked: frozenset[str] = frozenset()) -> Preds:
    """Upstream replica-stages of every replica-stage of one group: modules in data-flow order,
    each module's replicas in DP order, each replica's stages consecutive; a replica's first
    stage waits for the last stage of every upstream replica it takes samples from
    (``comm.routes.routes`` over the group's ``samples`` slots; every one across a boundary with a
    ``linked`` (post-balanced) module)."""
    index = {n: i for i, n in enumerate(names)}
    last: dict[str, list[int]] = {}
    preds: list[tuple[int, ...]] = []
    for n, ups in zip(names, upstream):
        c, pp = replicas[index[n]], pps[index[n]]
        last[n] = []
        feeds: list[set[int]] = [set() for _ in range(c)]  # each replica's upstream last stages
        for u in ups:
            if {u, n} & linked:
                for r in range(c):
                    feeds[r].update(last[u])
                continue
            for rt in routes(samples, replicas[index[u]], c):
                feeds[rt.down].add(last[u][rt.up])
        for r in range(c):
            preds.append(tuple(sorted(feeds[r])))
            preds.extend((len(preds) - 1,) for _ in range(pp - 1))
            last[n].append(len(preds) - 1)
    return tuple(preds)


def group_stage_times(times: np.ndarray, plan_: Plan, arrangement: np.ndarray,
                      post: PostBalance | None = None, auto: Auto = None) -> np.ndarray:
    """``[G, K, S]`` fwd+bwd time of every replica-stage of each of the :func:`replica_groups`
    per step (columns as :func:`_group_preds`): the replica's load / PP on each of its stages."""
    g = replica_groups(plan_, post, auto)
    loads = replica_loads(times, plan_, arrangement, post, auto)
    k = len(loads[0])
    cols = [np.repeat(x.reshape(k, g, m.dp // g) / m.pp, m.pp, axis=2) for x, m in zip(loads, plan_.modules.values())]
    return np.concatenate(cols, axis=2).transpose(1, 0, 2)


def _span(times: np.ndarray, plan_: Plan, arrangement: np.ndarray, order: list[int],
          lock_step: bool, post: PostBalance | None = None, auto: Auto = None) -> float:
    """Simulated makespan of one arrangement and step order (module docstring)."""
    if lock_step:
        fwd, bwd = split_fwd_bwd(stage_times(times, plan_, arrangement, post, auto)[order])
        _, preds = graph_stages(plan_.graph, _pp(plan_))
        return makespan_1f1b(fwd, bwd) if is_chain(preds) else makespan_dag(fwd, bwd, preds)
    graph, g = plan_.graph, replica_groups(plan_, post, auto)
    linked = frozenset(n for n in graph.names if n != graph.llm) if post is not None else frozenset()
    linked |= frozenset(auto or ())  # an adaptive module's group leads change every microbatch
    preds = _group_preds(graph.names, tuple(graph.upstream(n) for n in graph.names),
                         tuple(m.dp // g for m in plan_.modules.values()),
                         tuple(m.pp for m in plan_.modules.values()), _step_size(plan_) // g, linked)
    groups = group_stage_times(times, plan_, arrangement, post, auto)[:, order]
    return float(makespans(*split_fwd_bwd(groups), preds).max())


def simulate_iteration(times: np.ndarray, plan_: Plan, *, intra: bool = False,
                       inter: bool = False, budget_s: float = 0.5, seed: int = 0,
                       lock_step: bool = False, post: PostBalance | None = None, auto: Auto = None) -> IterationSim:
    """Simulate one iteration of ``plan_`` on ``times`` (``[global_batch, modules]`` ms from
    :func:`sample_times`, in loader order): the slowest replica group's 1F1B, or with
    ``lock_step`` every stage at its slowest replica's pace (module docstring). ``intra`` and
    ``inter`` reorder (the latter searches up to ``budget_s`` seconds on the lock-step stage
    times, or their ``simulate.longest_path_view`` for parallel encoders or generators); each
    is kept only when the iteration does not get longer. ``post``: per-module post-balancing
    (module docstring); ``auto``: the modules at adaptive SP groups (``AUTO_SP``), each with the
    ``sp_auto.draw_cost`` its groups are chosen by."""
    times = np.asarray(times, dtype=np.float64)
    shape = (plan_.microbatches * _step_size(plan_), len(plan_.modules))
    if times.shape != shape:
        raise ValueError(f"times must be {list(shape)}, got {list(times.shape)}")
    order = list(range(plan_.microbatches))
    arrangement = np.arange(len(times))
    if auto:  # the group search runs once per step: freeze its loads for this iteration's order
        auto = _Frozen(auto)
    span = _span(times, plan_, arrangement, order, lock_step, post, auto)
    if intra:
        balanced = balance_steps(times, plan_)
        t = _span(times, plan_, balanced, order, lock_step, post, auto)
        if t <= span:
            arrangement, span = balanced, t
    stages = stage_times(times, plan_, arrangement, post, auto)
    if inter:
        _, preds = graph_stages(plan_.graph, _pp(plan_))
        view = stages if is_chain(preds) else longest_path_view(stages, plan_.graph, _pp(plan_))
        found = inter_microbatch_reorder(*split_fwd_bwd(view), time_budget_s=budget_s, seed=seed)
        t = _span(times, plan_, arrangement, found, lock_step, post, auto)
        if t < span:
            order, span = list(found), t
    return IterationSim(float(span), stages[order], arrangement, tuple(order))


def simulate_scaled(times: np.ndarray, plan_: Plan, scales: np.ndarray) -> np.ndarray:
    """Makespans of ``simulate_iteration(times[b] * scales[i], plan_)`` (loader order, no
    reordering) in one sweep: layouts with ``plan_``'s DP and PP degrees that differ only in each
    module's per-sample cost (their TP degree), on one batch (``times`` ``[global_batch,
    modules]``; returns ``[L]``) or several (``[B, global_batch, modules]``; returns ``[L, B]``);
    ``scales`` is ``[L, modules]``."""
    times = np.asarray(times, dtype=np.float64)
    scales = np.asarray(scales, dtype=np.float64)
    batches = times.reshape((-1,) + times.shape[-2:])
    graph, g = plan_.graph, replica_groups(plan_)
    mods = list(plan_.modules.values())
    preds = _group_preds(graph.names, tuple(graph.upstream(n) for n in graph.names),
                         tuple(m.dp // g for m in mods), tuple(m.pp for m in mods), _step_size(plan_) // g)
    every = np.arange(batches.shape[1])
    groups = np.stack([group_stage_times(t, plan_, every) for t in batches])  # [B, G, K, S]
    module_of = np.repeat(np.arange(len(mods)), [m.dp // g * m.pp for m in mods])
    stages = groups[None] * scales[:, module_of][:, None, None, None, :]
    spans = makespans(*split_fwd_bwd(stages), preds, quick=False).max(axis=-1)  # [L, B]
    return spans if times.ndim == 3 else spans[:, 0]


class _Frozen(dict):
    """``auto`` with each module's replica loads memoised per arrangement of one iteration."""

    def __init__(self, auto: Mapping[str, SPCost]):
        super().__init__(auto)
        self.loads: dict[tuple[str, bytes], np.ndarray] = {}


def straggler_factors(times: np.ndarray, plan_: Plan) -> np.ndarray:
    """``[modules]`` mean over the steps of (slowest replica's load / mean replica load) per
    module, samples in loader order: how much data heterogeneity stretches each module's stage."""
    d = _step_size(plan_)
    steps = np.asarray(times, dtype=np.float64).reshape(-1, d, len(plan_.modules))
    dp = np.array([m.dp for m in plan_.modules.values()])
    return (replica_max(steps, plan_) / (steps.sum(axis=1) / dp)).mean(axis=0)

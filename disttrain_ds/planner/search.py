"""Exact search for the minimum-T_iter layout of a module graph (``optimize.plan`` calls it).

Per D = DP_llm * M (a divisor of the global batch), every module's layouts are listed as numpy
columns and the objective of :mod:`disttrain_ds.planner.objective` is minimised exactly:

1. D values are visited in increasing order of a lower bound (every module at its own smallest
   warm-up term and stage time); the search stops once a bound exceeds the best T_iter found.
2. Each module keeps the layouts that fit beside the other modules' smallest ones and whose
   optimistic T_iter (the others at their best) does not exceed the incumbent, and of those the
   non-dominated ones (``units.pareto``).
3. The modules of one role (parallel encoders, parallel generators) are folded into one *unit*
   (:mod:`disttrain_ds.planner.units`): the objective sees a role only through W = max warm-up,
   S = max stage time and G = summed GPUs, and a combination survives only if each member is
   the cheapest layout of its module inside the combination's (W, S) box.
4. Every (LLM layout, encoder unit, generator unit) triple is evaluated as one numpy array;
   triples in which some module's first rank is not a multiple of its TP degree are infeasible.

Rank placement (``placement.py``): modules take contiguous rank ranges from 0 in data-flow order
and a TP group is TP consecutive ranks, so a module whose first rank is a multiple of its TP
degree never puts a TP group across two nodes (TP divides ``gpus_per_node``). The search is
restricted to such aligned plans; no GPU is left idle for alignment. Whether a module starts
aligned depends on the GPUs before it modulo the largest TP degree, so steps 2 and 3 compare
layouts only within an alignment class (TP degree, GPUs modulo that number).

Ties go to fewer GPUs, then the smaller (tp, pp, dp) of each module in the graph's data-flow
order (``objective.layout_key``); units rank their combinations in that lexicographic order, so
the tie-break survives folding and the result equals ``optimize.exhaustive_plan`` bit for bit.

Complexity per visited D, with n_i layouts surviving step 2 for module i: O(n_i^2) for the
dominance test (chunked; skipped above ``units.PARETO_MAX`` layouts, where it only saves time); one
fold of units of sizes a and b costs O(a * b + (a + b)^2); step 4 costs O(n_llm * |E| * |G|) for
the encoder and generator units. A graph with at most one encoder and one generator folds
nothing, which is the three-module search as it always was; each extra parallel module
multiplies the unit size by at most its own n_i before pruning (in practice far less).

Memory couples modules through 1F1B's microbatches in flight along the whole chain (an encoder's
count depends on the LLM's and the generators' pipeline degrees, ``memory_model.stages_to_end``):
where that changes which layouts fit, each (LLM PP, longest generator PP) pair is a group of its
own (``options``' ``down``), which keeps the search exact.

With per-sample cost draws (:mod:`disttrain_ds.planner.hetero`) a D's layouts are priced with
the straggler factors only when the search visits it (step 2 onwards); step 1's bound from mean
costs stays a lower bound because every factor is >= 1.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Mapping

import numpy as np

from disttrain_ds.cost import memory_model as mm
from disttrain_ds.cost.profile import AUTO_SP, Profile
from disttrain_ds.planner.hetero import StragglerTable
from disttrain_ds.planner.objective import Degrees, Roles, combine_arrays, divisors, layout_key, memory_bytes, sp_key
from disttrain_ds.planner.placement import alignment
from disttrain_ds.planner.units import Opts, Unit, pareto, role_unit


def module_grid(profile: Profile, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tp, pp, C(tp, sp), sp) of every measured TP degree, SP degree (``ModuleProfile.sp_degrees``,
    and ``AUTO_SP`` where the module has SP overheads and a draw: ``options`` keeps it for the DP
    degrees ``ModuleProfile.auto_sp`` allows) and pipeline degree of module ``name``."""
    spec = profile.modules[name]
    auto = (AUTO_SP,) if spec.sp_overhead_ms and spec.sample_cost_ms is not None else ()
    pairs = [(t, s) for t in spec.tp_degrees(profile.gpus_per_node)
             for s in (*spec.sp_degrees(profile.gpus_per_node, t), *auto)]
    pps = spec.pp_degrees()
    tp = np.repeat(np.array([t for t, _ in pairs], dtype=np.int64), len(pps))
    sp = np.repeat(np.array([s for _, s in pairs], dtype=np.int64), len(pps))
    cost = np.repeat(np.array([spec.cost(t, s) for t, s in pairs], dtype=np.float64), len(pps))
    return tp, np.tile(np.array(pps, dtype=np.int64), len(pairs)), cost, sp


def downstream_splits(profile: Profile) -> list[tuple[int, int]]:
    """Every (LLM pipeline degree, longest generator's pipeline degree) pair (0: no generator):
    what the microbatches in flight of every module depend on besides its own degree."""
    graph = profile.graph
    gens = sorted({p for g in graph.generators for p in profile.modules[g].pp_degrees()}) or [0]
    return [(p, g) for p in profile.modules[graph.llm].pp_degrees() for g in gens]


def down_key(graph: Roles, name: str, down: tuple[int, int]) -> tuple[int, ...]:
    """The part of (P, G) module ``name``'s options depend on (``options``)."""
    if name == graph.llm:
        return down
    return (down[0] + down[1],) if name in graph.encoders else (down[1],)


def _columns(profile: Profile, name: str, d: int, cap: int, grid: tuple[np.ndarray, ...],
             is_llm: bool, align: int) -> dict[str, np.ndarray]:
    """Every (dp, tp, pp, sp) of module ``name`` at D = d as flat columns (rows: dp, then the
    grid's order), with ``ok``: within ``cap`` GPUs and the adaptive-SP rule; what ``options``
    filters for memory and the downstream split."""
    spec = profile.modules[name]
    tp0, pp0, cost0, sp0 = grid
    dps = np.array([d // profile.microbatch] if is_llm else divisors(d), dtype=np.int64)
    dp = dps[:, None]  # rows: dp; columns: (tp, pp) combinations
    tp, pp, cost, sp = tp0[None, :], pp0[None, :], cost0[None, :], sp0[None, :]
    m = np.full_like(dp, profile.microbatch) if is_llm else d // dp
    ranks = np.maximum(sp, 1)  # AUTO_SP: groups form inside the dp replicas
    gpus = dp * tp * pp * ranks
    ok = gpus <= cap
    if (sp == AUTO_SP).any():
        allowed = {(int(a), int(t)): spec.auto_sp(int(a), int(t)) for a in dps for t in np.unique(tp)}
        ok = ok & ((sp != AUTO_SP) | np.vectorize(lambda a, t: allowed[(a, t)], otypes=[bool])(dp, tp))
    warm = m * cost
    block = tp * ranks
    cols = {"dp": dp, "tp": tp, "pp": pp, "gpus": gpus, "warm": warm, "stage": warm / pp,
            "rank": ((tp * 1024 + sp_key(sp)) * (spec.layers + 1) + pp) * (d + 1) + dp,
            "cls": (block * 1024 + gpus % align) * (align > 1),  # align < 1024; one class when not aligned
            "sp": sp, "block": block, "m": m, "ranks": ranks}
    keep = ok.ravel()
    return {k: np.broadcast_to(c, gpus.shape).ravel()[keep] for k, c in cols.items()}


def options(profile: Profile, name: str, d: int, cap: int, limit: float | None,
            grid: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
            llm: str | None = None, align: int | None = None,
            down: tuple[int, int] | None = None, restrict: bool = True,
            memo: dict | None = None) -> Opts:
    """Every (dp, tp, pp, sp) of module ``name`` at D = d within ``cap`` GPUs and the memory limit;
    ``grid``, ``llm`` (the LLM's name) and ``align`` only save looking them up again, ``memo``
    (a dict kept across calls for one profile) computing the D's columns again.

    ``down`` = (P, G): the plans whose LLM runs P stages and whose generators at most G (0: none),
    so the LLM keeps only pp = P, every generator pp <= G, and the microbatches in flight are
    counted for a chain ending with G generator stages (for a plan whose longest generator is
    shorter, an over-count: that plan is also met, counted exactly, under its own G). None: no
    restriction, in flight counted with the smallest P and G (the fewest). ``restrict=False``:
    ``down`` only counts the microbatches in flight (the most, for the largest P and G)."""
    spec = profile.modules[name]
    graph = profile.graph
    is_llm = name == (graph.llm if llm is None else llm)
    align = alignment(profile) if align is None else align
    whole = (name, d, cap, align, limit, down, restrict)
    if memo is not None and whole in memo:
        return memo[whole]
    key = (name, d, cap, align)
    c = None if memo is None else memo.get(key)
    if c is None:
        c = _columns(profile, name, d, cap, grid if grid is not None else module_grid(profile, name), is_llm, align)
        if memo is not None:
            memo[key] = c
    if down is None:
        gens = [min(profile.modules[g].pp_degrees(), default=1) for g in graph.generators]
        p_llm, g_max = min(profile.modules[graph.llm].pp_degrees(), default=1), max(gens, default=0)
        keep = None
    else:
        p_llm, g_max = down
        keep = None
        if restrict:
            pp = c["pp"]
            keep = pp == p_llm if is_llm else pp <= g_max if name in graph.generators else None
    if keep is not None:
        c = {k: v[keep] for k, v in c.items()}
    role = "llm" if is_llm else graph.role(name)
    pp = c["pp"]
    to_end = mm.stages_to_end(role, pp, pp if is_llm else p_llm, g_max)
    mem = np.broadcast_to(memory_bytes(spec, c["dp"], c["tp"], pp, c["m"], to_end, profile.global_batch // d,
                                       c["ranks"]), pp.shape)
    fields = ("dp", "tp", "pp", "gpus", "warm", "stage", "mem", "rank", "cls", "sp", "block")
    ok = mem <= limit if limit is not None else slice(None)
    out = Opts(*(mem[ok] if f == "mem" else c[f][ok] for f in fields))
    if memo is not None:
        memo[whole] = out
    return out


def priced(profile: Profile, name: str, o: Opts, d: int, table: StragglerTable) -> Opts:
    """``o`` priced with the straggler factors h and g (``objective.module_terms``)."""
    m = np.full_like(o.dp, profile.microbatch) if name == profile.graph.llm else d // o.dp
    h, g = table.factors(name, o.dp, m), table.factors(name, o.dp, m, o.pp)
    auto = o.sp == AUTO_SP
    if auto.any():  # adaptive groups: their own factors
        h, g = h.copy(), g.copy()
        h[auto] = table.auto_factors(name, o.dp[auto], m[auto], 1, o.tp[auto])
        g[auto] = table.auto_factors(name, o.dp[auto], m[auto], o.pp[auto], o.tp[auto])
    return replace(o, warm=o.warm * h, stage=(o.warm * g) / o.pp)


def batch_splits(profile: Profile) -> list[int]:
    """Every D = DP_llm * M that divides the global batch."""
    m = profile.microbatch
    return [d for d in divisors(profile.global_batch) if d % m == 0]


def _within(graph: Roles, opts: Mapping[str, Opts], k: int, n_gpus: int,
            bound: float | None) -> dict[str, Opts] | None:
    """Each module's layouts that fit beside the other modules' smallest and whose optimistic
    T_iter (the others at their best) does not exceed ``bound``; None when a module has none."""
    wmin = {n: float(o.warm.min()) for n, o in opts.items()}
    smin = {n: float(o.stage.min()) for n, o in opts.items()}
    gmin = {n: int(o.gpus.min()) for n, o in opts.items()}
    out = {}
    for n in (graph.llm,) + graph.encoders + graph.generators:  # the LLM empties first, if any
        o = opts[n]
        keep = o.gpus <= n_gpus - (sum(gmin.values()) - gmin[n])
        if bound is not None:  # optimistic T_iter with the other modules at their best
            keep &= combine_arrays(graph, {**wmin, n: o.warm}, {**smin, n: o.stage}, k) <= bound
        if not keep.any():
            return None
        out[n] = o.take(keep)
    return out


def _prune(graph: Roles, opts: Mapping[str, Opts], k: int, n_gpus: int,
           bound: float | None) -> dict[str, Opts] | None:
    """Remove layouts that cannot be part of a plan within ``n_gpus`` and ``bound``, then keep
    each module's non-dominated layouts."""
    kept = _within(graph, opts, k, n_gpus, bound)
    return None if kept is None else {n: pareto(o) for n, o in kept.items()}


def _starts_ok(unit: Unit, opts: Mapping[str, Opts], align: int) -> np.ndarray:
    """``[n, align]``: whether every member of each combination starts at a multiple of its TP
    degree when the unit's first rank is r (mod ``align``), members laid out in order."""
    r = np.arange(align)[None, :]
    ok = np.ones((len(unit), align), dtype=bool)
    prefix = np.zeros(len(unit), dtype=np.int64)
    for j, name in enumerate(unit.names):
        o, idx = opts[name], unit.pick[:, j]
        ok &= (r + prefix[:, None]) % o.block[idx][:, None] == 0
        prefix = prefix + o.gpus[idx]
    return ok


def aligned_mask(lm: Opts, en: Unit, ge: Unit, opts: Mapping[str, Opts], align: int) -> np.ndarray:
    """``[llm, encoders * generators]``: whether the plan gives every module a first rank that is
    a multiple of its TP degree (ranks from 0 in data-flow order: encoders, LLM, generators), so
    no TP group spans two nodes of ``gpus_per_node`` (a multiple of every TP degree)."""
    enc_ok = _starts_ok(en, opts, align)[:, 0]
    gen_ok = _starts_ok(ge, opts, align)
    llm_ok = en.gpus[None, :] % lm.block[:, None] == 0
    start = (en.gpus[None, :] + lm.gpus[:, None]) % align  # the generators' first rank
    ok = (enc_ok[None, :] & llm_ok)[:, :, None] & gen_ok[np.arange(len(ge))[None, None, :],
                                                         start[:, :, None]]
    return ok.reshape(len(lm), -1)


def _best_in_group(graph: Roles, opts: Mapping[str, Opts], units: tuple[Unit, Unit],
                   k: int, n_gpus: int, align: int) -> tuple | None:
    """Exact best (key, layout) for one D by evaluating every (llm, encoders, generators)."""
    lm, (en, ge) = opts[graph.llm], units
    wp = (en.warm[:, None] + ge.warm[None, :]).ravel()
    sp = np.maximum(en.stage[:, None], ge.stage[None, :]).ravel()
    gp = (en.gpus[:, None] + ge.gpus[None, :]).ravel()
    warm = lm.warm[:, None] + wp[None, :]
    total = warm + np.maximum(lm.stage[:, None], sp[None, :]) * (k - 1)
    total[gp[None, :] > (n_gpus - lm.gpus)[:, None]] = np.inf
    if align > 1:
        total[~aligned_mask(lm, en, ge, opts, align)] = np.inf
    tmin = float(total.min())
    if tmin == np.inf:
        return None
    best = None
    for li, pi in zip(*np.nonzero(total == tmin)):
        ei, gi = divmod(int(pi), len(ge))
        layout = {graph.llm: _degrees(lm, int(li))}
        for unit, row in ((en, ei), (ge, gi)):
            layout.update({n: _degrees(opts[n], int(j))
                           for n, j in zip(unit.names, unit.pick[row])})
        key = layout_key(tmin, layout, graph.names)
        if best is None or key < best[0]:
            best = (key, layout)
    return best


def _degrees(o: Opts, j: int) -> Degrees:
    return Degrees(int(o.dp[j]), int(o.tp[j]), int(o.pp[j]), int(o.sp[j]))


def search(profile: Profile, caps: Mapping[str, int], table: StragglerTable | None = None,
           aligned: bool = True) -> dict[str, Degrees] | None:
    """The exact minimum-T_iter layout with module i on at most ``caps[i]`` GPUs, or None;
    ``aligned``: only layouts whose modules start at multiples of their TP degree.

    With ``table`` (straggler factors h >= 1) a D's layouts are priced only when it is visited:
    its bound from mean costs is still a lower bound, so the search stays exact."""
    found = finalists(profile, caps, table, aligned, 1)
    return found[0] if found else None


def finalists(profile: Profile, caps: Mapping[str, int], table: StragglerTable | None = None,
              aligned: bool = True, count: int = 1, memo: dict | None = None) -> list[dict[str, Degrees]]:
    """The ``count`` best layouts among each group's best (a group: one samples-per-step D and
    memory variant), best first, exactly: a group is skipped only when its lower bound exceeds the
    ``count``-th best found. ``count`` = 1: ``search``'s layout. ``memo``: a dict kept across
    searches of one profile and caps (the layouts do not depend on ``table``)."""
    graph, n_gpus, limit = Roles.of(profile.graph), profile.gpus, profile.memory_limit_bytes
    grids = {n: module_grid(profile, n) for n in graph.names}
    align = alignment(profile) if aligned else 1
    # Memory couples modules: the microbatches in flight depend on the LLM's and the generators'
    # pipeline degrees. When the limit keeps the same layouts counted with the fewest in flight
    # (``options`` without ``down``) and with the most (``worst``), it does not depend on them;
    # otherwise every (P, G) of ``downstream_splits`` is its own group.
    downs = [None] if limit is None else downstream_splits(profile)
    worst = None if limit is None else (max(p for p, _ in downs), max(g for _, g in downs))
    memo = {} if memo is None else memo

    def bound_of(opts: Mapping[str, Opts], k: int) -> float | None:
        if min(len(o) for o in opts.values()) == 0 or sum(int(o.gpus.min()) for o in opts.values()) > n_gpus:
            return None
        return float(combine_arrays(graph, {n: float(o.warm.min()) for n, o in opts.items()},
                                    {n: float(o.stage.min()) for n, o in opts.items()}, k))

    def variants(d: int, free: dict[str, Opts]) -> list[dict[str, Opts]]:
        """The D's groups: ``free`` itself, or one per (P, G) where memory binds differently."""
        if limit is None or all(
                len(free[n]) == len(options(profile, n, d, caps[n], limit, grids[n], graph.llm, align,
                                            worst, restrict=False, memo=memo)) for n in graph.names):
            return [free]
        # A module's options depend only on part of (P, G): equal parts share one computation.
        cache: dict = {}
        out = []
        for down in downs:
            opts = {}
            for n in graph.names:
                key = (n, down_key(graph, n, down))
                if key not in cache:
                    cache[key] = options(profile, n, d, caps[n], limit, grids[n], graph.llm, align, down, memo=memo)
                opts[n] = cache[key]
            out.append(opts)
        return out

    # Groups are visited in order of a lower bound. A D enters with its bound over ``free`` (the
    # fewest microbatches in flight: every variant's layouts are among them, so it bounds them
    # all) and is split into its memory variants only when visited.
    heap: list[tuple] = []
    seq = 0
    for d in batch_splits(profile):
        k = profile.global_batch // d
        free = {n: options(profile, n, d, caps[n], limit, grids[n], graph.llm, align, memo=memo)
                for n in graph.names}
        lb = bound_of(free, k)
        if lb is not None:
            heapq.heappush(heap, (lb, d, seq, k, free, True))
            seq += 1
    top: list[tuple] = []  # (key, layout) of the best groups so far, best first
    while heap:
        lb, d, _, k, opts, whole_d = heapq.heappop(heap)
        bound = top[-1][0][0] if len(top) == count else None
        if bound is not None and lb > bound:
            break  # groups come in order of a valid lower bound: none of the rest can win
        if whole_d:
            for v in variants(d, opts):
                if (vlb := bound_of(v, k)) is not None:
                    heapq.heappush(heap, (vlb, d, seq, k, v, False))
                    seq += 1
            continue
        if table is not None:
            # Factors are >= 1: what the bound rules out at mean costs it rules out priced, so
            # only the rest is priced.
            unpriced = _within(graph, opts, k, n_gpus, bound) if bound is not None else opts
            if unpriced is None:
                continue
            opts = {n: priced(profile, n, o, d, table) for n, o in unpriced.items()}
        opts = _prune(graph, opts, k, n_gpus, bound)
        if opts is None:
            continue
        units = tuple(role_unit(graph, names, opts, k, n_gpus, bound, align)
                      for names in (graph.encoders, graph.generators))
        if units[0] is None or units[1] is None:
            continue
        found = _best_in_group(graph, opts, units, k, n_gpus, align)
        if found is not None and all(found[1] != layout for _, layout in top):
            top = sorted([*top, found], key=lambda x: x[0])[:count]
    return [layout for _, layout in top]

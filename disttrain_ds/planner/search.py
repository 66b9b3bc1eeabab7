"""Exact search for the minimum-T_iter layout of a module graph (``optimize.plan`` calls it).

Per D = DP_llm * M (a divisor of the global batch), every module's layouts are listed as numpy
columns and the objective of :mod:`disttrain_ds.planner.objective` is minimised exactly:

1. D values are visited in increasing order of a lower bound (every module at its own smallest
   warm-up term and stage time); the search stops once a bound exceeds the best T_iter found.
2. Each module keeps the layouts that fit beside the other modules' smallest ones and whose
   optimistic T_iter (the others at their best) does not exceed the incumbent, and of those the
   non-dominated ones (``_pareto``).
3. The modules of one role (parallel encoders, parallel generators) are folded into one *unit*:
   the objective sees a role only through W = max warm-up, S = max stage time and G = summed
   GPUs, so the unit lists member combinations with those three values. A combination survives
   only if each member is the cheapest layout of its module (fewest GPUs, then tie-break rank)
   inside the combination's (W, S) box; any other is beaten by swapping that member in.
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
dominance test (chunked; skipped above ``PARETO_MAX`` layouts, where it only saves time); one
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

from dataclasses import dataclass, fields, replace
from typing import Mapping

import numpy as np

from disttrain_ds.planner.objective import (Degrees, Roles, combine_arrays, divisors,
                                            layout_key, memory_bytes)
from disttrain_ds.planner import memory_model as mm
from disttrain_ds.planner.hetero import StragglerTable
from disttrain_ds.planner.placement import alignment, start_masks
from disttrain_ds.planner.profile import Profile

PARETO_MAX = 20_000
"""Largest option list the O(n^2) dominance test runs on."""
_CHUNK = 4_000_000  # boolean cells per dominance block
_SMALL_FOLD = 64  # class pairs with at most this many combinations skip the box test


@dataclass(frozen=True)
class Opts:
    """Candidate layouts of one module for one D, as parallel columns."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    gpus: np.ndarray
    warm: np.ndarray
    stage: np.ndarray
    mem: np.ndarray
    rank: np.ndarray
    """Lexicographic rank of (tp, pp, dp), for tie-breaking."""
    cls: np.ndarray
    """Alignment class (tp, gpus mod ``align``): layouts of one class are interchangeable for
    where every module's ranks start, so dominance only compares within a class."""

    def take(self, sel: np.ndarray) -> "Opts":
        return Opts(*(getattr(self, f)[sel] for f in _OPTS_FIELDS))

    def __len__(self) -> int:
        return len(self.dp)


@dataclass(frozen=True)
class Unit:
    """The modules of one role as one option list (a single module's layouts, or combinations)."""

    names: tuple[str, ...]
    """Member modules in data-flow order (empty for a role without modules)."""
    gpus: np.ndarray
    """Summed GPUs of the members."""
    warm: np.ndarray
    """Largest warm-up term of the members (they run side by side)."""
    stage: np.ndarray
    """Largest stage time of the members."""
    rank: np.ndarray
    """Lexicographic rank of the members' (tp, pp, dp) tuples in member order."""
    pick: np.ndarray
    """``[n, len(names)]``: each member's index into its module's Opts."""
    cls: np.ndarray
    """Alignment class: equal when every member has the same ``Opts.cls``."""

    def take(self, sel: np.ndarray) -> "Unit":
        return Unit(self.names, *(getattr(self, f)[sel] for f in _UNIT_COLUMNS))

    def __len__(self) -> int:
        return len(self.gpus)


_OPTS_FIELDS = tuple(f.name for f in fields(Opts))
_UNIT_COLUMNS = tuple(f.name for f in fields(Unit))[1:]


def module_grid(profile: Profile, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tp, pp, C(tp)) of every measured TP degree and pipeline degree of module ``name``."""
    spec = profile.modules[name]
    tps = spec.tp_degrees(profile.gpus_per_node)
    pps = spec.pp_degrees()
    tp = np.repeat(np.array(tps, dtype=np.int64), len(pps))
    cost = np.repeat(np.array([spec.cost_ms[t] for t in tps], dtype=np.float64), len(pps))
    return tp, np.tile(np.array(pps, dtype=np.int64), len(tps)), cost


def downstream_splits(profile: Profile) -> list[tuple[int, int]]:
    """Every (LLM pipeline degree, longest generator's pipeline degree) pair (0: no generator):
    what the microbatches in flight of every module depend on besides its own degree."""
    graph = profile.graph
    gens = sorted({p for g in graph.generators for p in profile.modules[g].pp_degrees()}) or [0]
    return [(p, g) for p in profile.modules[graph.llm].pp_degrees() for g in gens]


def _down_key(graph: Roles, name: str, down: tuple[int, int]) -> tuple[int, ...]:
    """The part of (P, G) module ``name``'s options depend on (``options``)."""
    if name == graph.llm:
        return down
    return (down[0] + down[1],) if name in graph.encoders else (down[1],)


def options(profile: Profile, name: str, d: int, cap: int, limit: float | None,
            grid: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
            llm: str | None = None, align: int | None = None,
            down: tuple[int, int] | None = None, restrict: bool = True) -> Opts:
    """Every (dp, tp, pp) of module ``name`` at D = d within ``cap`` GPUs and the memory limit;
    ``grid``, ``llm`` (the LLM's name) and ``align`` only save looking them up again.

    ``down`` = (P, G): the plans whose LLM runs P stages and whose generators at most G (0: none),
    so the LLM keeps only pp = P, every generator pp <= G, and the microbatches in flight are
    counted for a chain ending with G generator stages (for a plan whose longest generator is
    shorter, an over-count: that plan is also met, counted exactly, under its own G). None: no
    restriction, in flight counted with the smallest P and G (the fewest). ``restrict=False``:
    ``down`` only counts the microbatches in flight (the most, for the largest P and G)."""
    spec = profile.modules[name]
    graph = profile.graph
    is_llm = name == (graph.llm if llm is None else llm)
    tp0, pp0, cost0 = grid if grid is not None else module_grid(profile, name)
    if down is None:
        gens = [min(profile.modules[g].pp_degrees(), default=1) for g in graph.generators]
        p_llm, g_max = min(profile.modules[graph.llm].pp_degrees(), default=1), max(gens, default=0)
    else:
        p_llm, g_max = down
        if restrict:
            keep = pp0 == p_llm if is_llm else pp0 <= g_max if name in graph.generators else pp0 > 0
            tp0, pp0, cost0 = tp0[keep], pp0[keep], cost0[keep]
    dps = np.array([d // profile.microbatch] if is_llm else divisors(d), dtype=np.int64)
    dp = dps[:, None]  # rows: dp; columns: (tp, pp) combinations
    tp, pp, cost = tp0[None, :], pp0[None, :], cost0[None, :]
    m = np.full_like(dp, profile.microbatch) if is_llm else d // dp
    warm = m * cost
    role = "llm" if is_llm else graph.role(name)
    to_end = mm.stages_to_end(role, pp, pp if is_llm else p_llm, g_max)
    gpus = dp * tp * pp
    mem = np.broadcast_to(memory_bytes(spec, dp, tp, pp, m, to_end, profile.global_batch // d), gpus.shape)
    ok = gpus <= cap
    if limit is not None:
        ok &= mem <= limit
    rank = (tp * (spec.layers + 1) + pp) * (d + 1) + dp
    align = alignment(profile) if align is None else align
    cls = (tp * 16 + gpus % align) * (align > 1)  # align <= 8 < 16; one class when not aligned
    cols = (dp, tp, pp, gpus, warm, warm / pp, mem, rank, cls)
    return Opts(*(np.broadcast_to(c, gpus.shape)[ok] for c in cols))


def priced(profile: Profile, name: str, o: Opts, d: int, table: StragglerTable) -> Opts:
    """``o`` priced with the straggler factors h and g (``objective.module_terms``)."""
    m = np.full_like(o.dp, profile.microbatch) if name == profile.graph.llm else d // o.dp
    return replace(o, warm=o.warm * table.factors(name, o.dp, m),
                   stage=(o.warm * table.factors(name, o.dp, m, o.pp)) / o.pp)


def batch_splits(profile: Profile) -> list[int]:
    """Every D = DP_llm * M that divides the global batch."""
    m = profile.microbatch
    return [d for d in divisors(profile.global_batch) if d % m == 0]


def _pareto(o):
    """Drop layouts some other layout of the same alignment class beats: no more GPUs, warm-up or
    stage time, and fewer GPUs or an earlier tie-break rank. Swapping it in never worsens T_iter
    (float sums are monotone), the GPU count or the tie-break, and leaves every module's first
    rank modulo its TP degree as it was, so the exact optimum survives. Works on Opts and Unit."""
    n = len(o)
    if n <= 1 or n > PARETO_MAX:
        return o
    g, w, s, r, c = o.gpus, o.warm, o.stage, o.rank, o.cls
    dominated = np.zeros(n, dtype=bool)
    step = max(1, _CHUNK // n)
    for lo in range(0, n, step):  # rows: candidate dominators
        a = slice(lo, lo + step)
        dom = (g[a, None] <= g) & (w[a, None] <= w) & (s[a, None] <= s) \
            & ((g[a, None] < g) | (r[a, None] < r)) & (c[a, None] == c)
        dominated |= dom.any(axis=0)
    return o.take(~dominated)


def _unit(name: str, o: Opts, align: int, at_zero: bool) -> Unit:
    """One module as a unit. A unit's class is (mask, GPUs mod ``align``) as mask * align + GPUs
    mod align, mask having bit r set when every member starts aligned from a first rank = r;
    ``at_zero``: the unit starts at rank 0 (the encoders), so only bit 0 matters."""
    mask = np.ones(len(o), dtype=np.int64) if at_zero else start_masks(o.tp, align)
    return Unit((name,), o.gpus, o.warm, o.stage, o.rank, np.arange(len(o))[:, None],
                mask * align + o.gpus % align)


def _empty_unit() -> Unit:
    """A role without modules: nothing to add to the critical path, no GPUs."""
    z, i = np.zeros(1), np.zeros(1, dtype=np.int64)
    return Unit((), i, z, z, i, np.zeros((1, 0), dtype=np.int64), i)


def _dense(x: np.ndarray) -> np.ndarray:
    """0-based dense rank of distinct integers."""
    return np.unique(x, return_inverse=True)[1].reshape(-1)


def _box_min(wi: np.ndarray, si: np.ndarray, key: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """table[i, j] = smallest ``key`` of the options with warm index <= i and stage index <= j."""
    table = np.full(shape, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(table, (wi, si), key)
    return np.minimum.accumulate(np.minimum.accumulate(table, axis=0), axis=1)


def _fold_pairs(a: Unit, b: Unit) -> tuple[np.ndarray, np.ndarray]:
    """(ia, ib) of the combinations of ``a`` and ``b`` in which each member is the cheapest of
    its option list inside the combination's (W, S) box."""
    wv = np.unique(np.concatenate([a.warm, b.warm]))
    sv = np.unique(np.concatenate([a.stage, b.stage]))
    aw, as_ = np.searchsorted(wv, a.warm), np.searchsorted(sv, a.stage)
    bw, bs = np.searchsorted(wv, b.warm), np.searchsorted(sv, b.stage)
    ka = a.gpus * len(a) + _dense(a.rank)  # orders like (gpus, rank), unique
    kb = b.gpus * len(b) + _dense(b.rank)
    ta = _box_min(aw, as_, ka, (len(wv), len(sv)))
    tb = _box_min(bw, bs, kb, (len(wv), len(sv)))
    ia = np.repeat(np.arange(len(a)), len(b))
    ib = np.tile(np.arange(len(b)), len(a))
    iw, is_ = np.maximum(aw[ia], bw[ib]), np.maximum(as_[ia], bs[ib])
    keep = (ta[iw, is_] == ka[ia]) & (tb[iw, is_] == kb[ib])
    return ia[keep], ib[keep]


def _fold(a: Unit, b: Unit, gpu_room: int, within_bound, align: int, at_zero: bool) -> Unit:
    """Combinations of ``a`` and ``b`` (members side by side, ``b``'s ranks after ``a``'s) that
    can still be optimal; the cheapest-member test runs per pair of classes, and pairs that
    cannot start aligned from any first rank (from rank 0 when ``at_zero``) are dropped."""
    ua, a_of = np.unique(a.cls, return_inverse=True)
    ub, b_of = np.unique(b.cls, return_inverse=True)
    a_of, b_of = a_of.reshape(-1), b_of.reshape(-1)
    na, nb = np.bincount(a_of), np.bincount(b_of)
    joined = np.zeros((len(ua), len(ub)), dtype=np.int64)  # class of the pair; 0: never aligned
    for i, ca in enumerate(ua.tolist()):
        ma, ga = divmod(ca, align)
        for j, cb in enumerate(ub.tolist()):
            mb, gb = divmod(cb, align)
            mask = sum(1 << r for r in range(align) if ma >> r & 1 and mb >> ((r + ga) % align) & 1)
            mask &= 1 if at_zero else mask
            joined[i, j] = mask * align + (ga + gb) % align if mask else 0
    small = (joined > 0) & (na[:, None] * nb[None, :] <= _SMALL_FOLD)
    # Small class pairs keep every combination (extra ones only cost time), in one go.
    ia, ib = np.nonzero(small[a_of[:, None], b_of[None, :]])
    ias, ibs, clss = [ia], [ib], [joined[a_of[ia], b_of[ib]]]
    for i, j in zip(*np.nonzero((joined > 0) & ~small)):
        sa, sb = np.nonzero(a_of == i)[0], np.nonzero(b_of == j)[0]
        ia, ib = _fold_pairs(a.take(sa), b.take(sb))
        ias.append(sa[ia])
        ibs.append(sb[ib])
        clss.append(np.full(len(ia), joined[i, j], dtype=np.int64))
    ia, ib, cls = np.concatenate(ias), np.concatenate(ibs), np.concatenate(clss)
    gpus = a.gpus[ia] + b.gpus[ib]
    warm, stage = np.maximum(a.warm[ia], b.warm[ib]), np.maximum(a.stage[ia], b.stage[ib])
    rank = np.empty(len(ia), dtype=np.int64)
    rank[np.lexsort((b.rank[ib], a.rank[ia]))] = np.arange(len(ia))  # (a, b) lexicographic
    u = Unit(a.names + b.names, gpus, warm, stage, rank,
             np.concatenate([a.pick[ia], b.pick[ib]], axis=1), cls)
    return _pareto(u.take((gpus <= gpu_room) & within_bound(u.names, warm, stage)))


def _role_unit(graph: Roles, names: tuple[str, ...], opts: Mapping[str, Opts], k: int,
               n_gpus: int, bound: float | None, align: int) -> Unit | None:
    """The unit of modules ``names`` (one role), folding them one by one in data-flow order."""
    at_zero = names == graph.encoders  # encoders take the ranks from 0
    if not names:
        return _empty_unit()
    if len(names) == 1:
        return _unit(names[0], opts[names[0]], align, at_zero)
    wmin = {n: float(o.warm.min()) for n, o in opts.items()}
    smin = {n: float(o.stage.min()) for n, o in opts.items()}
    gmin = {n: int(o.gpus.min()) for n, o in opts.items()}

    def within_bound(members, warm, stage):
        if bound is None:
            return np.ones(len(warm), dtype=bool)
        # Members all get the unit's max: max(W, W) = W, so the critical path sees W.
        w = {**wmin, **{m: warm for m in members}}
        s = {**smin, **{m: stage for m in members}}
        return combine_arrays(graph, w, s, k) <= bound

    unit = _unit(names[0], opts[names[0]], align, at_zero)
    for n in names[1:]:
        folded = unit.names + (n,)
        room = n_gpus - sum(g for m, g in gmin.items() if m not in folded)
        unit = _fold(unit, _unit(n, opts[n], align, False), room, within_bound, align, at_zero)
        if len(unit) == 0:
            return None
    return unit


def _prune(graph: Roles, opts: Mapping[str, Opts], k: int, n_gpus: int,
           bound: float | None) -> dict[str, Opts] | None:
    """Remove layouts that cannot be part of a plan within ``n_gpus`` and ``bound``, then keep
    each module's non-dominated layouts."""
    wmin = {n: float(o.warm.min()) for n, o in opts.items()}
    smin = {n: float(o.stage.min()) for n, o in opts.items()}
    gmin = {n: int(o.gpus.min()) for n, o in opts.items()}
    out = {}
    for n in (graph.llm,) + graph.encoders + graph.generators:  # the LLM empties first, if any
        o = opts[n]
        keep = o.gpus <= n_gpus - (sum(gmin.values()) - gmin[n])
        if bound is not None:  # optimistic T_iter with the other modules at their best
            keep &= combine_arrays(graph, {**wmin, n: o.warm}, {**smin, n: o.stage}, k) <= bound
        o = _pareto(o.take(keep))
        if len(o) == 0:
            return None
        out[n] = o
    return out


def _starts_ok(unit: Unit, opts: Mapping[str, Opts], align: int) -> np.ndarray:
    """``[n, align]``: whether every member of each combination starts at a multiple of its TP
    degree when the unit's first rank is r (mod ``align``), members laid out in order."""
    r = np.arange(align)[None, :]
    ok = np.ones((len(unit), align), dtype=bool)
    prefix = np.zeros(len(unit), dtype=np.int64)
    for j, name in enumerate(unit.names):
        o, idx = opts[name], unit.pick[:, j]
        ok &= (r + prefix[:, None]) % o.tp[idx][:, None] == 0
        prefix = prefix + o.gpus[idx]
    return ok


def aligned_mask(lm: Opts, en: Unit, ge: Unit, opts: Mapping[str, Opts], align: int) -> np.ndarray:
    """``[llm, encoders * generators]``: whether the plan gives every module a first rank that is
    a multiple of its TP degree (ranks from 0 in data-flow order: encoders, LLM, generators), so
    no TP group spans two nodes of ``gpus_per_node`` (a multiple of every TP degree)."""
    enc_ok = _starts_ok(en, opts, align)[:, 0]
    gen_ok = _starts_ok(ge, opts, align)
    llm_ok = en.gpus[None, :] % lm.tp[:, None] == 0
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
    return Degrees(int(o.dp[j]), int(o.tp[j]), int(o.pp[j]))


def search(profile: Profile, caps: Mapping[str, int], table: StragglerTable | None = None,
           aligned: bool = True) -> dict[str, Degrees] | None:
    """The exact minimum-T_iter layout with module i on at most ``caps[i]`` GPUs, or None;
    ``aligned``: only layouts whose modules start at multiples of their TP degree.

    With ``table`` (straggler factors h >= 1) a D's layouts are priced only when it is visited:
    its bound from mean costs is still a lower bound, so the search stays exact."""
    graph, n_gpus, limit = Roles.of(profile.graph), profile.gpus, profile.memory_limit_bytes
    grids = {n: module_grid(profile, n) for n in graph.names}
    align = alignment(profile) if aligned else 1
    # Memory couples modules: the microbatches in flight depend on the LLM's and the generators'
    # pipeline degrees. When the limit keeps the same layouts counted with the fewest in flight
    # (``options`` without ``down``) and with the most (``worst``), it does not depend on them;
    # otherwise every (P, G) of ``downstream_splits`` is its own group.
    downs = [None] if limit is None else downstream_splits(profile)
    worst = None if limit is None else (max(p for p, _ in downs), max(g for _, g in downs))
    groups = []
    for d in batch_splits(profile):
        k = profile.global_batch // d

        free = {n: options(profile, n, d, caps[n], limit, grids[n], graph.llm, align) for n in graph.names}
        variants = [free]
        if limit is not None and any(
                len(free[n]) != len(options(profile, n, d, caps[n], limit, grids[n], graph.llm, align,
                                            worst, restrict=False)) for n in graph.names):
            # Memory binds differently for some (P, G): each is its own group. A module's
            # options depend only on part of (P, G), so equal parts share one computation.
            cache: dict = {}
            variants = []
            for down in downs:
                opts = {}
                for n in graph.names:
                    key = (n, _down_key(graph, n, down))
                    if key not in cache:
                        cache[key] = options(profile, n, d, caps[n], limit, grids[n], graph.llm, align, down)
                    opts[n] = cache[key]
                variants.append(opts)
        for opts in variants:
            if min(len(o) for o in opts.values()) == 0 \
                    or sum(int(o.gpus.min()) for o in opts.values()) > n_gpus:
                continue
            lb = float(combine_arrays(graph, {n: float(o.warm.min()) for n, o in opts.items()},
                                      {n: float(o.stage.min()) for n, o in opts.items()}, k))
            groups.append((lb, d, len(groups), k, opts))
    best: tuple | None = None
    for lb, d, _, k, opts in sorted(groups, key=lambda g: (g[0], g[1], g[2])):
        if best is not None and lb > best[0][0]:
            break  # groups are sorted by a valid lower bound: none of the rest can win
        bound = None if best is None else best[0][0]
        if table is not None:
            opts = {n: priced(profile, n, o, d, table) for n, o in opts.items()}
        opts = _prune(graph, opts, k, n_gpus, bound)
        if opts is None:
            continue
        units = tuple(_role_unit(graph, names, opts, k, n_gpus, bound, align)
                      for names in (graph.encoders, graph.generators))
        if units[0] is None or units[1] is None:
            continue
        found = _best_in_group(graph, opts, units, k, n_gpus, align)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else best[1]

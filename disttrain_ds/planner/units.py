"""Option lists and units of the exact search (``search.py``): one module's candidate layouts
for one D as numpy columns (:class:`Opts`), the dominance filter every list goes through, and the
folding of a role's parallel modules into one :class:`Unit`.

A role (parallel encoders, parallel generators) is seen by the objective only through W = max
warm-up term, S = max stage time and G = summed GPUs, so a unit lists member combinations with
those three values. A combination survives only if each member is the cheapest layout of its
module (fewest GPUs, then tie-break rank) inside the combination's (W, S) box; any other is
beaten by swapping that member in. Comparisons stay within an alignment class (where every
module's ranks can start), so the search's node rule survives pruning and folding.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

import numpy as np

from disttrain_ds.planner.objective import Roles, combine_arrays
from disttrain_ds.planner.placement import start_masks

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
    """Lexicographic rank of (tp, sp, pp, dp), for tie-breaking."""
    cls: np.ndarray
    """Alignment class (block, gpus mod ``align``): layouts of one class are interchangeable for
    where every module's ranks start, so dominance only compares within a class."""
    sp: np.ndarray
    """Sequence-parallel degree (1 but for an LLM whose profile lists SP costs)."""
    block: np.ndarray
    """tp x sp: consecutive ranks that must start at a multiple of it (inside a node)."""

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


def pareto(o):
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
    mask = np.ones(len(o), dtype=np.int64) if at_zero else start_masks(o.block, align)
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
    return pareto(u.take((gpus <= gpu_room) & within_bound(u.names, warm, stage)))


def role_unit(graph: Roles, names: tuple[str, ...], opts: Mapping[str, Opts], k: int,
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

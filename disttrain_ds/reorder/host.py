"""Reordering that keeps every sample on the host that read it (``data.read: host`` with ``data.reorder``).

Every position of a global batch has a *class*: the set of hosts whose ranks consume it
(``host_read.reader_classes``). A host reads exactly the positions of its classes, so an order
that puts every sample on a position of its own class moves no sample across hosts. Classes
depend only on a position's offset inside its microbatch slot (every slot is split over the DP
replicas alike), hence permuting whole microbatches (inter-microbatch reordering) keeps them.

Inside that constraint:

* *membership*: a class's samples may change microbatch. ``host_microbatches`` either keeps the
  loader's grouping or deals each class's samples heaviest first into the microbatches, so a
  microbatch's heavy samples on one host meet heavy samples on the others (the DP groups of one
  microbatch sit on different hosts when each host holds one replica; only matching sizes across
  hosts balances them there);
* *split*: ``class_lpt`` splits one microbatch across its DP groups, equal counts per group and
  class, heaviest first to the least-loaded group with room for that class, then pairwise swaps
  of same-class samples with the heaviest group.

Bound: the constrained orders are a subset of the unconstrained ones, so the unconstrained
optimum is never worse. Per microbatch, the split's heaviest group is at most
``max_h(L_h / G_h) + c_max`` (``L_h`` the load a host's class holds in the microbatch, ``G_h`` its
groups, ``c_max`` the largest sample) against ``L / G`` unconstrained: what is lost is the
imbalance between the hosts' loads per group, which the membership step narrows by matching
sizes across hosts. ``bench/bench_host_reorder.py`` measures it on the paper's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_EPS = 1e-12


def check_classes(labels: Sequence[int], slot: int) -> np.ndarray:
    """``labels`` as an array; ``ValueError`` unless every microbatch slot repeats the first one."""
    lab = np.asarray(labels, dtype=np.int64)
    if slot < 1 or lab.ndim != 1 or len(lab) % slot:
        raise ValueError(f"{len(lab)} position labels do not split into slots of {slot}")
    rows = lab.reshape(-1, slot)
    if (rows != rows[0]).any():
        raise ValueError("position labels differ between microbatch slots: whole microbatches could not move")
    return lab


def class_lpt(costs: Sequence[float], labels: Sequence[int], groups: int, max_swaps: int | None = None) -> list[list[int]]:
    """One microbatch split over ``groups`` equal blocks of its slot: sample ``i`` has label
    ``labels[i]`` (its slot offset's class) and goes to a block holding as many offsets of that
    label as before. Returns each block's sample indices (ascending); never a max load above the
    unreordered split's."""
    c = np.asarray(costs, dtype=np.float64)
    lab = np.asarray(labels, dtype=np.int64)
    n = len(c)
    if groups < 1 or n % groups or len(lab) != n:
        raise ValueError(f"{n} samples with {len(lab)} labels do not split into {groups} equal groups")
    width = n // groups
    identity = [list(range(r * width, (r + 1) * width)) for r in range(groups)]
    room = {(r, int(k)): int((lab[r * width:(r + 1) * width] == k).sum()) for r in range(groups) for k in set(lab.tolist())}
    loads = np.zeros(groups)
    members: list[list[int]] = [[] for _ in range(groups)]
    for i in np.argsort(-c, kind="stable"):
        k = int(lab[i])
        open_ = [r for r in range(groups) if room[(r, k)] > 0]
        r = min(open_, key=lambda g: (loads[g], g))
        room[(r, k)] -= 1
        members[r].append(int(i))
        loads[r] += c[i]
    members = _class_swaps(c, lab, members, 4 * n if max_swaps is None else max_swaps)
    if _max_load(c, members) > _max_load(c, identity) + _EPS * max(1.0, float(c.sum())):
        members = identity
    return [sorted(m) for m in members]


def _max_load(c: np.ndarray, members: list[list[int]]) -> float:
    return max(float(c[m].sum()) for m in members)


def _class_swaps(c: np.ndarray, lab: np.ndarray, members: list[list[int]], max_swaps: int) -> list[list[int]]:
    """Swap a sample of the heaviest group with a same-label sample of another group while that
    lowers the larger of the two loads."""
    owner = np.empty(len(c), dtype=np.int64)
    for r, m in enumerate(members):
        owner[m] = r
    loads = np.array([c[m].sum() for m in members])
    for _ in range(max_swaps):
        r = int(np.argmax(loads))
        mine, others = np.flatnonzero(owner == r), np.flatnonzero(owner != r)
        if len(mine) == 0 or len(others) == 0:
            break
        d = c[mine][:, None] - c[others][None, :]
        pair = np.maximum(loads[r] - d, loads[owner[others]][None, :] + d)
        bad = (d <= _EPS) | (lab[mine][:, None] != lab[others][None, :]) | (pair >= loads[r] - _EPS * max(1.0, loads[r]))
        pair[bad] = np.inf
        flat = int(np.argmin(pair))
        if not np.isfinite(pair.flat[flat]):
            break
        a, b = int(mine[flat // len(others)]), int(others[flat % len(others)])
        q = int(owner[b])
        owner[a], owner[b] = q, r
        loads[r] -= c[a] - c[b]
        loads[q] += c[a] - c[b]
    return [np.flatnonzero(owner == r).tolist() for r in range(len(members))]


def host_microbatches(total: Sequence[float], labels: Sequence[int], slot: int, sort: bool) -> list[list[int]]:
    """Each microbatch's samples (global indices, in slot-offset order of their class): the
    loader's consecutive ones, or with ``sort`` each class's samples dealt heaviest first, so
    microbatch ``j`` holds the ``j``-th heaviest share of every class."""
    c = np.asarray(total, dtype=np.float64)
    lab = check_classes(labels, slot)
    m = len(c) // slot
    if not sort:
        return [list(range(j * slot, (j + 1) * slot)) for j in range(m)]
    out = [[-1] * slot for _ in range(m)]
    for k in np.unique(lab[:slot]):
        offsets = np.flatnonzero(lab[:slot] == k)
        mine = np.flatnonzero(lab == k)
        heavy = mine[np.argsort(-c[mine], kind="stable")]
        for j in range(m):
            for t, off in enumerate(offsets):
                out[j][off] = int(heavy[j * len(offsets) + t])
    return out


def place(groups_in_order: list[list[list[int]]], labels: Sequence[int] | None, slot: int) -> list[int]:
    """The batch's order (position ``q`` holds sample ``order[q]``): microbatches in execution
    order, each group's block in turn; with ``labels``, each offset takes the group's next sample
    of the offset's class."""
    if labels is None:
        return [i for mb in groups_in_order for g in mb for i in g]
    lab = np.asarray(labels)[:slot]
    out = []
    for mb in groups_in_order:
        width = slot // len(mb)
        for r, g in enumerate(mb):
            queue = {int(k): [i for i in g if labels[i] == k] for k in np.unique(lab)}
            for off in range(r * width, (r + 1) * width):
                out.append(queue[int(lab[off])].pop(0))
    return out

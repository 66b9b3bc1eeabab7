"""A microbatch's DP split refined module by module.

The split by summed cost (``reorder.intra_microbatch_reorder``) evens each group's total over all
modules. Each module, though, waits for its own slowest replica, and modules of one pipeline stage
(two encoders on their own ranks, an image and an audio encoder) run side by side: a split whose
totals are even can still put both image-heavy samples on one group and both clip-heavy ones on
the other, so the image encoder and the audio encoder each have one replica doing all the work.
``refine_split`` swaps samples between groups while that lowers the sum over pipeline stages of
the stage's slowest module group (ties: the sum of squared group loads), as the inter-microbatch
order prices a microbatch; only swaps with some module's slowest group are tried. Pure and
deterministic unless its time budget runs out. Counts per group never change.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

_EPS = 1e-12


def split_objective(loads: np.ndarray, stages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum over stages of the stage's slowest module group, sum of squared loads) of group loads
    ``[..., k, G]`` (module, group); ``stages[m]``: the pipeline stage of module ``m``."""
    slowest = loads.max(axis=-1)  # [..., k]
    total = np.zeros(slowest.shape[:-1])
    for s in np.unique(stages):
        total = total + slowest[..., stages == s].max(axis=-1)
    return total, (loads * loads).sum(axis=(-1, -2))


def refine_split(costs: np.ndarray, groups: Sequence[Sequence[int]], stages: Sequence[int],
                 max_swaps: int | None = None, deadline: float = math.inf,
                 classes: Sequence[int] | None = None) -> list[list[int]]:
    """``groups`` (sample indices per DP group) after steepest pairwise swaps between groups that
    lower :func:`split_objective` (at most ``max_swaps``, default one per sample, and none after
    ``time.perf_counter()`` passes ``deadline``); ``costs[i, m]``: sample ``i``'s cost in module
    ``m``. With ``classes`` (a label per sample), only samples of one label swap (they stay on
their hosts, ``reorder/host.py``). Each group's indices come back ascending."""
    c = np.asarray(costs, dtype=np.float64)
    out = [sorted(int(i) for i in g) for g in groups]
    if len(out) < 2 or c.size == 0:
        return out
    st = np.asarray(stages)
    owner = np.empty(c.shape[0], dtype=np.int64)
    for g, members in enumerate(out):
        owner[members] = g
    loads = np.stack([c[members].sum(axis=0) for members in out], axis=-1)  # [k, G]
    best = split_objective(loads, st)
    a, b = np.triu_indices(c.shape[0], k=1)
    if classes is not None:
        label = np.asarray(classes)
        same = label[a] == label[b]
    for _ in range(max_swaps if max_swaps is not None else c.shape[0]):
        if time.perf_counter() >= deadline:
            break
        # Only a swap with a module's slowest group can lower the sum of the stages' slowest.
        hot = np.zeros(len(out), dtype=bool)
        hot[loads.argmax(axis=1)] = True
        keep = (owner[a] != owner[b]) & (hot[owner[a]] | hot[owner[b]])
        if classes is not None:
            keep &= same
        pa, pb = a[keep], b[keep]
        if len(pa) == 0:
            break
        ga, gb, d = owner[pa], owner[pb], c[pb] - c[pa]  # group ga takes b and gives a
        trial = np.repeat(loads[None], len(pa), axis=0)
        rows = np.arange(len(pa))
        trial[rows, :, ga] += d
        trial[rows, :, gb] -= d
        span, tie = split_objective(trial, st)
        tol = _EPS * max(1.0, best[0])
        better = (span < best[0] - tol) | ((span <= best[0] + tol) & (tie < best[1] - _EPS * max(1.0, best[1])))
        if not better.any():
            break
        pick = np.flatnonzero(better)[np.lexsort((tie[better], span[better]))[0]]
        i, j = int(pa[pick]), int(pb[pick])
        loads = trial[pick]
        best = (span[pick], tie[pick])
        gi, gj = int(owner[i]), int(owner[j])
        out[gi][out[gi].index(i)] = j
        out[gj][out[gj].index(j)] = i
        owner[i], owner[j] = gj, gi
    return [sorted(g) for g in out]

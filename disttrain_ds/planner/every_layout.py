"""Every feasible layout of a profile, as numpy columns (for benchmarks and tests that score
layouts one by one; the planner's search prunes instead, ``search.py``).

Per D = DP_llm * M, each module's options are ``search.options`` (the same rules the search
applies: measured TP / SP degrees, PP dividing the layers, memory) and a layout is one option per
module with at most ``gpus`` GPUs in all, every module starting at a multiple of its TP x SP block
(``placement.py``) when ``aligned``. With a memory limit, the microbatches in flight depend on the
LLM's and the longest generator's PP, so each (P, G) of ``search.downstream_splits`` is listed
with exactly those degrees and counted exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from disttrain_ds.cost.profile import Profile
from disttrain_ds.planner.objective import Degrees
from disttrain_ds.planner.placement import alignment
from disttrain_ds.planner.search import batch_splits, downstream_splits, options
from disttrain_ds.planner.units import Opts

MAX_LAYOUTS = 50_000_000
"""Largest product of option lists one D may have (memory guard)."""


@dataclass(frozen=True)
class LayoutSet:
    """The feasible layouts of one D: row i takes option ``pick[i, j]`` of module j."""

    d: int
    """Samples per pipeline step (DP_llm x microbatch)."""
    opts: dict[str, Opts]
    """Module name -> its options at this D (unpriced: ``warm`` = samples per replica x C)."""
    pick: np.ndarray
    """``[layouts, modules]`` option indices, modules in the graph's data-flow order."""

    def __len__(self) -> int:
        return len(self.pick)

    def degrees(self, i: int) -> dict[str, Degrees]:
        """Layout ``i`` as the planner's degrees."""
        out = {}
        for j, (n, o) in enumerate(self.opts.items()):
            x = int(self.pick[i, j])
            out[n] = Degrees(int(o.dp[x]), int(o.tp[x]), int(o.pp[x]), int(o.sp[x]))
        return out


def every_layout(profile: Profile, aligned: bool = True) -> Iterator[LayoutSet]:
    """The feasible layouts of ``profile``, one :class:`LayoutSet` per D (and memory variant)."""
    graph, limit, n_gpus = profile.graph, profile.memory_limit_bytes, profile.gpus
    align = alignment(profile) if aligned else 1
    downs = [None] if limit is None else downstream_splits(profile)
    for d in batch_splits(profile):
        for down in downs:
            opts = {n: options(profile, n, d, n_gpus, limit, align=align, down=down) for n in graph.names}
            sizes = [len(o) for o in opts.values()]
            if min(sizes) == 0:
                continue
            if int(np.prod(sizes, dtype=np.int64)) > MAX_LAYOUTS:
                raise ValueError(f"D={d}: {np.prod(sizes, dtype=np.int64)} option combinations exceed {MAX_LAYOUTS}")
            pick = np.stack([g.ravel() for g in np.meshgrid(*(np.arange(s) for s in sizes), indexing="ij")], axis=1)
            gpus = np.stack([o.gpus[pick[:, j]] for j, o in enumerate(opts.values())], axis=1)
            ok = gpus.sum(axis=1) <= n_gpus
            if align > 1:  # ranks from 0 in data-flow order: each module's first rank a multiple of its block
                first = np.cumsum(gpus, axis=1) - gpus
                for j, o in enumerate(opts.values()):
                    ok &= first[:, j] % o.block[pick[:, j]] == 0
            if down is not None:  # exactly this (P, G): the longest generator at G
                gens = [j for j, n in enumerate(opts) if n in graph.generators]
                if gens:
                    ok &= np.max([opts[graph.names[j]].pp[pick[:, j]] for j in gens], axis=0) == down[1]
            if ok.any():
                yield LayoutSet(d, opts, pick[ok])

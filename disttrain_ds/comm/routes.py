"""Who sends which samples to whom across a module boundary (pure functions).

One microbatch slot holds ``slot = DP_llm * micro_batch`` samples in a fixed order. By default every
module splits the slot into contiguous, equal blocks over its DP replicas, so across a boundary
between DP sizes ``dp_up`` and ``dp_down`` each upstream replica sends each downstream replica
exactly the samples both own. With per-module post-balancing (``reorder/post_balance.py``) a
module's replicas hold any samples of the slot (``owners``: the replica of each position); each
replica keeps its samples in slot order, and a message carries the samples both ends hold, in that
order (``pieces``, ``row_index``). With blocks the pairs split into ``gcd(dp_up, dp_down)``
independent broker groups (the paper's fan-in / fan-out); inside a group, messages keep sample
order, so concatenating what a replica receives in upstream-rank order reproduces its block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One message per microbatch across a boundary."""

    up: int
    """Upstream DP replica index."""
    down: int
    """Downstream DP replica index."""
    samples: range
    """Slot positions carried, contiguous."""


def blocks(slot: int, dp: int) -> list[range]:
    """Contiguous sample block of each DP replica."""
    if dp < 1 or slot % dp:
        raise ValueError(f"a slot of {slot} samples does not split evenly over {dp} replicas")
    n = slot // dp
    return [range(r * n, (r + 1) * n) for r in range(dp)]


def routes(slot: int, dp_up: int, dp_down: int) -> list[Route]:
    """All (upstream, downstream, shared samples) triples, upstream-major, in sample order."""
    ups, downs = blocks(slot, dp_up), blocks(slot, dp_down)
    out = []
    for u, bu in enumerate(ups):
        for d, bd in enumerate(downs):
            lo, hi = max(bu.start, bd.start), min(bu.stop, bd.stop)
            if lo < hi:
                out.append(Route(u, d, range(lo, hi)))
    return out


def broker_groups(dp_up: int, dp_down: int) -> int:
    """Independent groups of replicas that exchange samples only among themselves."""
    return math.gcd(dp_up, dp_down)


def block_owners(slot: int, dp: int) -> list[int]:
    """The replica of each slot position under contiguous, equal blocks."""
    return [r for r, b in enumerate(blocks(slot, dp)) for _ in b]


def owned(owners: Sequence[int], replica: int) -> list[int]:
    """The slot positions ``replica`` holds, ascending: its local sample order."""
    return [p for p, o in enumerate(owners) if o == replica]


def pieces(mine: Sequence[int], other: Sequence[int], replicas: int) -> list[list[int]]:
    """For each replica of the other side, the indices into ``mine`` (this replica's positions,
    ascending) of the samples that replica holds (``other``: the other side's owner per position)."""
    out: list[list[int]] = [[] for _ in range(replicas)]
    for i, p in enumerate(mine):
        out[other[p]].append(i)
    return out


def row_index(rows_per_sample: Sequence[int], samples: Sequence[int]) -> list[int]:
    """Rows of a tensor packed over a replica's samples (``rows_per_sample`` each, in order) that
    belong to the local samples ``samples``, in that order."""
    starts = [0]
    for n in rows_per_sample:
        starts.append(starts[-1] + n)
    return [r for i in samples for r in range(starts[i], starts[i + 1])]


def pair_links(owners_up: Sequence[Sequence[int]], owners_down: Sequence[Sequence[int]]) -> set[tuple[int, int]]:
    """(upstream, downstream) replica pairs that share a sample in some microbatch."""
    return {(u, d) for ou, od in zip(owners_up, owners_down) for u, d in zip(ou, od)}

"""Who sends which samples to whom across a module boundary (pure functions).

One microbatch slot holds ``slot = DP_llm * micro_batch`` samples in a fixed order. Every module
splits the slot into contiguous, equal blocks over its DP replicas, so across a boundary between
DP sizes ``dp_up`` and ``dp_down`` each upstream replica sends each downstream replica exactly the
samples both own. The pairs split into ``gcd(dp_up, dp_down)`` independent broker groups (the
paper's fan-in / fan-out); inside a group, messages keep sample order, so concatenating what a
replica receives in upstream-rank order reproduces its block.
"""

from __future__ import annotations

import math
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


def routes_from(up: int, slot: int, dp_up: int, dp_down: int) -> list[Route]:
    """Messages one upstream replica sends, in sample order."""
    return [r for r in routes(slot, dp_up, dp_down) if r.up == up]


def routes_to(down: int, slot: int, dp_up: int, dp_down: int) -> list[Route]:
    """Messages one downstream replica receives, in sample order."""
    return sorted((r for r in routes(slot, dp_up, dp_down) if r.down == down), key=lambda r: r.samples.start)


def broker_groups(dp_up: int, dp_down: int) -> int:
    """Independent groups of replicas that exchange samples only among themselves."""
    return math.gcd(dp_up, dp_down)


def split_rows(rows_per_sample: list[int], my_block: range, pieces: list[range]) -> list[int]:
    """Row counts of each piece of a tensor packed over ``my_block``'s samples."""
    sizes = []
    for piece in pieces:
        lo, hi = piece.start - my_block.start, piece.stop - my_block.start
        sizes.append(sum(rows_per_sample[lo:hi]))
    return sizes

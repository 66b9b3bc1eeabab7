"""Where a plan's modules sit on the ranks, and the rule that keeps TP groups inside a node.

Modules take contiguous rank ranges from rank 0 in the graph's data-flow order (encoders, the LLM,
generators), as ``recipe/graph.py::topology_of`` lays them out, and a TP group is TP consecutive
ranks. A module whose first rank is a multiple of its TP degree, with TP dividing
``gpus_per_node``, never puts a TP group across two nodes: the planner only returns such plans
(``search.py`` restricts to them; nothing is padded, no GPU is left idle for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from disttrain_ds.cost.profile import Profile

if TYPE_CHECKING:
    from disttrain_ds.planner.objective import Degrees


def alignment(profile: Profile) -> int:
    """The largest TP x SP block any module may take: a power of two, so a module's first rank is
    a multiple of its block exactly when the GPUs before it are, modulo this number."""
    n = profile.gpus_per_node
    return max((t * s for m in profile.modules.values() for t in m.tp_degrees(n) for s in m.sp_degrees(n, t)),
               default=1)


def start_masks(block: np.ndarray, align: int) -> np.ndarray:
    """Bit r set when a module of TP x SP block ``block`` may start at a rank = r (mod ``align``)."""
    out = np.zeros(len(block), dtype=np.int64)
    for b in np.unique(block):
        out[block == b] = sum(1 << r for r in range(align) if r % int(b) == 0)
    return out


def first_ranks(layout: Mapping[str, Degrees], names: Sequence[str]) -> dict[str, int]:
    """Each module's first global rank: contiguous ranges from 0 in ``names`` order, as
    ``recipe/graph.py::topology_of`` lays them out."""
    out, first = {}, 0
    for n in names:
        out[n] = first
        first += layout[n].gpus
    return out


def tp_aligned(layout: Mapping[str, Degrees], names: Sequence[str]) -> bool:
    """Whether every module starts at a multiple of its TP x SP block, so that (the block dividing
    ``gpus_per_node``) none of its TP or SP groups spans two nodes."""
    return all(first % layout[n].block == 0 for n, first in first_ranks(layout, names).items())

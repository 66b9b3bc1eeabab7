"""How a module's step time scales with its tensor-parallel degree where it was not measured: the
one law the profiler's interpolation and the paper-scale simulations share."""

from __future__ import annotations

import math


def tp_scaled(cost: float, from_tp: int, to_tp: int, efficiency: float) -> float:
    """C(to_tp) from C(from_tp): each doubling of TP divides the time by ``2 * efficiency``,
    C(t) = C(b) / ((t / b) * efficiency ** log2(t / b)), in either direction."""
    ratio = to_tp / from_tp
    return cost / (ratio * efficiency ** math.log2(ratio))

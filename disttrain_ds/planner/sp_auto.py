"""Adaptive SP groups (``sp: auto``) priced on a profile's per-sample cost draw.

The runtime forms a module's groups every microbatch slot from its sequences' lengths
(``reorder/sp_groups.py``: ``covering_groups`` in the LLM, ``adaptive_groups`` in an encoder). The
planner knows samples by their costs, not their lengths, so here a sample of cost c (ms at SP 1)
is a sequence of ``SCALE * c / mean`` units: on a group of p replicas it takes c / p plus its
all-to-alls, ``sp_overhead_ms[p] / tp`` for a sample of the mean cost and in proportion to its
cost for others (the all-to-alls grow with the tokens, the compute at least as fast, so long
samples are charged somewhat more than their tokens move). Group sizes above the largest degree
the profile lists are charged that degree's bandwidth (the profile lists degrees up to a node:
larger groups cross nodes, which this does not price). Memory is the runtime's check at SP 1, so
any grouping fits.

Each replica's time in a step is its group's (idle encoder ranks: 0); the planner's straggler
factor for ``auto`` is the expected slowest replica over the mean replica load, as for SP 1
(``planner/hetero.py``), and the simulator runs the same groups (``planner/iteration_sim.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from disttrain_ds.reorder.sp_groups import SPCost, adaptive_groups, covering_groups

SCALE = 1000
"""Length units of a sample of the draw's mean cost (costs are rounded to 1 / SCALE of the mean)."""
STEPS = 12
"""Bisection steps of the group search (the makespan to 2^-12 of its bracket; the runtime takes 24)."""


def draw_cost(overhead: Mapping[int, float], cost_ms: float, tp: int) -> SPCost:
    """``SPCost`` of samples measured in 1 / ``SCALE`` of a mean sample whose SP 1 cost at TP ``tp``
    is ``cost_ms``: a sample of r mean samples takes r / p on a group of p, plus r times
    ``overhead[p] / tp`` over ``cost_ms`` for its all-to-alls (all in mean-sample units)."""
    if not overhead:
        raise ValueError("adaptive SP needs the module's sp_overhead_ms")
    # a2a_ms(L, p) = L (p-1) / (p^2 bandwidth 1e6) must be (L / SCALE) q_p.
    bandwidth = {}
    for p, ms in overhead.items():
        q = ms / tp / cost_ms
        bandwidth[p] = (p - 1) * SCALE / (p * p * 1e6 * q) if q > 0 else math.inf
    return SPCost(ms_per_flop=1.0 / SCALE, linear_flops=1.0, pair_flops=0.0, a2a_bytes_per_token=1.0,
                  bandwidth_gbs=bandwidth, tokens_per_gpu=math.inf)


def step_loads(costs: np.ndarray, dp: int, cost: SPCost, cover: bool) -> np.ndarray:
    """``[dp]`` each replica's time in one step of samples costing ``costs`` (mean-sample units),
    under the groups the runtime forms: ``cover`` (the LLM) every replica in a group that runs a
    sample, else (an encoder) ranks left idle where samples are few; samples costing 0 need no group."""
    loads = np.zeros(dp)
    real = np.asarray(costs, dtype=np.float64)
    real = real[real > 0]
    if not len(real):
        return loads
    lengths = np.maximum(1, np.rint(real * SCALE)).astype(np.int64).tolist()
    plan = covering_groups(lengths, dp, cost, STEPS) if cover else adaptive_groups(lengths, dp, cost, steps=STEPS)
    if plan is None:  # unbounded memory: every plan fits
        raise RuntimeError("no SP groups for a step of the draw")
    for g in plan.groups:
        loads[g.first:g.first + g.size] = g.ms
    return loads

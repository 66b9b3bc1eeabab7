"""The iteration time the runtime's 1F1B schedule makes of a layout's stage times.

The closed form T_iter (:mod:`disttrain_ds.planner.objective`) charges every module's whole
warm-up term along the critical path, then the slowest stage (K - 1) more times. The runtime
runs one non-interleaved 1F1B schedule over all modules' stages (DeepSpeed's ``TrainSchedule``
per global stage, ``schedule/onef1b.py``), in which the bottleneck stage runs its warm-up
forwards while the first microbatch's round trip through the later stages is under way, and its
cool-down backwards while the last one's is. So T_iter is an upper bound on the schedule's
makespan, and with few steps per iteration the gap is most of the later modules' warm-up terms
(MLLM-15B at the paper's scale: K = 4, the generator's round trip hidden behind the LLM's
forward, 7 % of T_iter).

:func:`predict` prices that exactly for deterministic stage times: every stage of module i runs
its stage time s_i per microbatch, forward : backward = 1 : ``BACKWARD_FACTOR``, and the
schedule's makespan M (``sweep.makespans`` over ``simulate.graph_stages``: the stage chain,
or the stage DAG of parallel encoders / generators, in ``TrainSchedule``'s op order) is compared with the
closed form over the same stage times, U_s = sum of pp_i * s_i along the critical path +
max s * (K - 1). The hidden part U_s - M >= 0 is taken off T_iter:

    T_pred = T_iter - (U_s - M)

Without per-sample draws (s_i = w_i / pp_i) this is M itself. With draws, w_i carries the
warm-up straggler factor h and s_i the steady-state one g >= h, and T_pred keeps T_iter's
warm-up pricing while crediting the overlap the schedule gives.

The search (``search.py``) minimises T_iter, exactly; T_pred <= T_iter for every layout, and
T_pred >= T_iter - D with D the summed stage times (pp_i * s_i) of the modules after the
bottleneck module along the critical path, since the bottleneck's last stage runs all K
microbatches between the forward and the backward path through the stages before it. So no
layout's T_pred is below the minimum T_iter minus its own D: the plan is exact for T_iter and
within the largest downstream D of the optimum of T_pred.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

# Backward time as a multiple of forward, as the runtime's emulated compute charges it.
from disttrain_ds.cost.backward import BACKWARD_FACTOR
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.objective import combine
from disttrain_ds.schedule.simulate import graph_stages
from disttrain_ds.schedule.sweep import makespans


def split_fwd_bwd(stage_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward parts of fwd+bwd stage times."""
    fwd = stage_ms / (1.0 + BACKWARD_FACTOR)
    return fwd, stage_ms - fwd


def stage_columns(graph: ModuleGraph, pp: Mapping[str, int],
                  stage: Mapping[str, float]) -> np.ndarray:
    """``[P]`` fwd+bwd time of every pipeline stage in ``simulate.graph_stages`` numbering."""
    return np.concatenate([np.full(pp[n], float(stage[n])) for n in graph.names])


def schedule_ms(graph: ModuleGraph, pp: Mapping[str, int], stage: Mapping[str, float],
                microbatches: int) -> float:
    """1F1B makespan of ``microbatches`` steps with every stage of module n at ``stage[n]``."""
    row = stage_columns(graph, pp, stage)
    fwd, bwd = split_fwd_bwd(np.broadcast_to(row, (microbatches, len(row))))
    return float(makespans(fwd, bwd, graph_stages(graph, pp)[1]))


def hidden_ms(graph: ModuleGraph, pp: Mapping[str, int], stage: Mapping[str, float],
              microbatches: int) -> float:
    """What the 1F1B schedule hides of the closed form over the same stage times: U_s - M."""
    bound = combine(graph, {n: pp[n] * stage[n] for n in graph.names}, stage, microbatches)
    return max(0.0, bound.total_ms - schedule_ms(graph, pp, stage, microbatches))


def predict(graph: ModuleGraph, pp: Mapping[str, int], t_iter_ms: float,
            stage: Mapping[str, float], microbatches: int) -> float:
    """T_pred = T_iter - hidden (module docstring)."""
    return t_iter_ms - hidden_ms(graph, pp, stage, microbatches)

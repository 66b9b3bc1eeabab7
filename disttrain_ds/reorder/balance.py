"""How evenly a step's encoder and generator work spreads over each module's DP replicas.

Every encoder (image or audio) and every generator of the graph has its own figures, under its
module name.

This is where straggler removal shows: in each microbatch slot the replicas run in lock-step, so
the slowest one sets the pace. Per slot, each replica's load is the cost-model estimate (forward
FLOPs) of the samples it processes, with the runtime's contiguous-block split; the figures are the
max and min over replicas relative to the slot's mean (1.0 = perfect), averaged over the step's
slots, and the mean load itself. Intra-microbatch reordering moves max and min towards 1.
"""

from __future__ import annotations

import numpy as np

from disttrain_ds.comm.routes import blocks


def module_columns(costs) -> dict[str, int]:
    """Module name -> its cost column in ``costs.costs`` (a ``cost.graph_costs.GraphCosts``): every
    module but the LLM (whose DP blocks are the microbatch slot's own split)."""
    return {n: costs.column(n) for n in costs.names if costs.role(n) != "llm"}


def dp_balance(costs: np.ndarray, slot: int, dp: dict[str, int], columns: dict[str, int]) -> dict[str, float]:
    """``balance/<module>_load_{max,min,mean}`` for per-sample costs ``[n, k]`` split into each
    module's contiguous blocks; ``columns``: module name -> its cost column (``module_columns``)."""
    loads = {module: [np.array([costs[start:start + slot][b, col].sum() for b in blocks(slot, dp[module])])
                      for start in range(0, costs.shape[0], slot)]
             for module, col in columns.items()}
    return balance_figures(loads)


def balance_figures(loads: dict[str, list[np.ndarray]]) -> dict[str, float]:
    """``balance/<module>_load_{max,min,mean}`` from each module's replica loads of every slot: the
    slowest and the least loaded replica over the mean, and the mean, averaged over the slots."""
    out: dict[str, float] = {}
    for module, per_slot in loads.items():
        highs, lows, means = [], [], []
        for row in per_slot:
            mean = row.mean()
            highs.append(row.max() / mean if mean else 1.0)  # nothing to do is perfectly balanced
            lows.append(row.min() / mean if mean else 1.0)
            means.append(mean)
        out[f"balance/{module}_load_max"] = float(np.mean(highs))
        out[f"balance/{module}_load_min"] = float(np.mean(lows))
        out[f"balance/{module}_load_mean"] = float(np.mean(means))
    return out

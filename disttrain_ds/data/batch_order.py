"""Reordering inside one global batch (``data.reorder``), run where the batch is prepared.

The global batch is cut into ``global_batch / (dp_size * micro_batch)`` consecutive microbatches.
Each is split across the LLM's DP ranks with equal sample counts, minimising the slowest rank
(intra-microbatch reordering) by each sample's cost summed over every module of the graph (both
encoders of an image + audio graph included), then refined module by module so each pipeline
stage's slowest module group is as light as pairwise swaps make it (``module_balance.py``); then
the microbatches are put in the order that minimises the simulated 1F1B makespan of a three-stage
pipeline (encoders -> LLM -> generators), where a module's time for a microbatch is its slowest DP
rank and a stage's time its slowest module's (inter-microbatch reordering). Costs come from
:class:`disttrain_ds.module_costs.GraphCosts`.

The returned batch reads as: microbatches in execution order; inside each, DP rank 0's
``micro_batch`` samples, then rank 1's, and so on. Samples never leave their global batch, so
the loss (normalised by global-batch totals) is unchanged.
"""

from __future__ import annotations

import time

import numpy as np

from .source import ShapeSpec
from .types import PackedSample, SpecialTokens

INTER_TIME_BUDGET_S = 1.0
"""Search budget of the inter-microbatch order; small batches finish far below it."""
REFINE_TIME_BUDGET_S = 1.0
"""Budget of the per-module refinement of all of a batch's DP splits; small batches finish far below it."""


def _cost_model(shape: ShapeSpec):
    from disttrain_ds.module_costs import as_graph_costs

    return as_graph_costs(shape.cost_model)


def _per_module(per_module: np.ndarray, mb: list[list[int]], stages: list[int], deadline: float) -> list[list[int]]:
    """One microbatch's DP groups (global sample indices) refined module by module."""
    from .module_balance import refine_split

    flat = [i for group in mb for i in group]
    at = {i: p for p, i in enumerate(flat)}
    refined = refine_split(per_module[flat], [[at[i] for i in group] for group in mb], stages, deadline=deadline)
    return [[flat[p] for p in group] for group in refined]


def reorder_batch(samples: list[PackedSample], shape: ShapeSpec, special: SpecialTokens) -> list[PackedSample]:
    """``samples`` regrouped by DP rank and reordered by microbatch (see the module docstring)."""
    from .reorder import build_microbatches, inter_microbatch_reorder

    dp = shape.dp_size
    per_rank = shape.micro_batch or len(samples) // dp
    slot = dp * per_rank
    if slot < 1 or len(samples) % slot:
        raise ValueError(f"data.reorder: global batch {len(samples)} is not a multiple of dp_size * micro_batch = {slot}")
    model = _cost_model(shape)
    per_module = model.costs([s.stats(shape.patch_size, special) for s in samples])  # [n, modules] forward
    total = per_module.sum(axis=1) * (1.0 + model.backward_factor)
    groups = build_microbatches(total, dp, len(samples) // slot)
    from disttrain_ds.module_costs import STAGE_ROLES

    stages = [STAGE_ROLES.index(model.role(n)) for n in model.names]
    deadline = time.perf_counter() + REFINE_TIME_BUDGET_S
    groups = [_per_module(per_module, mb, stages, deadline) for mb in groups]
    # A module's time for a microbatch = its slowest DP rank; a stage's = its slowest module.
    slowest = np.array([[max(per_module[ranks_idx, m].sum() for ranks_idx in mb) for m in range(per_module.shape[1])]
                        for mb in groups])
    fwd = model.stage_times(slowest)
    order = inter_microbatch_reorder(fwd, fwd * model.backward_factor, time_budget_s=INTER_TIME_BUDGET_S)
    return [samples[i] for j in order for rank in groups[j] for i in rank]

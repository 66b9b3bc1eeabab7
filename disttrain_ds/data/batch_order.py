"""Reordering inside one global batch (``data.reorder``), run where the batch is prepared.

The global batch is cut into ``global_batch / (dp_size * micro_batch)`` consecutive microbatches.
Each is split across the LLM's DP ranks with equal sample counts, minimising the slowest rank
(intra-microbatch reordering); then the microbatches are put in the order that minimises the
simulated 1F1B makespan of a three-stage pipeline (encoder -> LLM -> generator), where a stage's
time for a microbatch is its slowest DP rank (inter-microbatch reordering). Costs come from
:class:`disttrain_ds.costmodel.CostModel`.

The returned batch reads as: microbatches in execution order; inside each, DP rank 0's
``micro_batch`` samples, then rank 1's, and so on. Samples never leave their global batch, so
the loss (normalised by global-batch totals) is unchanged.
"""

from __future__ import annotations

import numpy as np

from .source import ShapeSpec
from .types import PackedSample, SpecialTokens

INTER_TIME_BUDGET_S = 1.0
"""Search budget of the inter-microbatch order; small batches finish far below it."""


def _cost_model(shape: ShapeSpec):
    from disttrain_ds.costmodel import CostModel

    return shape.cost_model if shape.cost_model is not None else CostModel.paper_mllm()


def reorder_batch(samples: list[PackedSample], shape: ShapeSpec, special: SpecialTokens) -> list[PackedSample]:
    """``samples`` regrouped by DP rank and reordered by microbatch (see the module docstring)."""
    from .reorder import build_microbatches, inter_microbatch_reorder

    dp = shape.dp_size
    per_rank = shape.micro_batch or len(samples) // dp
    slot = dp * per_rank
    if slot < 1 or len(samples) % slot:
        raise ValueError(f"data.reorder: global batch {len(samples)} is not a multiple of dp_size * micro_batch = {slot}")
    model = _cost_model(shape)
    per_module = model.costs([s.stats(shape.patch_size, special) for s in samples])  # [n, 3] forward
    total = per_module.sum(axis=1) * (1.0 + model.backward_factor)
    groups = build_microbatches(total, dp, len(samples) // slot)
    # Stage time of a microbatch = its slowest DP rank, per module.
    fwd = np.array([[max(per_module[ranks_idx, m].sum() for ranks_idx in mb) for m in range(3)] for mb in groups])
    order = inter_microbatch_reorder(fwd, fwd * model.backward_factor, time_budget_s=INTER_TIME_BUDGET_S)
    return [samples[i] for j in order for rank in groups[j] for i in rank]

"""Reordering inside one global batch (``data.reorder``), run where the batch is prepared.

The global batch is cut into ``global_batch / (dp_size * micro_batch)`` consecutive microbatches.
Each is split across the LLM's DP ranks with equal sample counts, minimising the slowest rank
(intra-microbatch reordering) by each sample's cost summed over every module of the graph (both
encoders of an image + audio graph included), then refined module by module so each pipeline
stage's slowest module group is as light as pairwise swaps make it (``module_balance.py``); then
the microbatches are put in the order that minimises the simulated 1F1B makespan of a three-stage
pipeline (encoders -> LLM -> generators), where a module's time for a microbatch is its slowest DP
rank and a stage's time its slowest module's (inter-microbatch reordering). Costs come from
:class:`disttrain_ds.cost.graph_costs.GraphCosts`.

The returned batch reads as: microbatches in execution order; inside each, DP rank 0's
``micro_batch`` samples, then rank 1's, and so on. Samples never leave their global batch, so
the loss (normalised by global-batch totals) is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from disttrain_ds.cost.graph_costs import STAGE_ROLES, as_graph_costs
from disttrain_ds.reorder.host import check_classes, class_lpt, host_microbatches, place
from disttrain_ds.reorder.intra import build_microbatches
from disttrain_ds.reorder.microbatch_order import inter_microbatch_reorder
from disttrain_ds.reorder.module_balance import refine_split
from disttrain_ds.samples import PackedSample, ShapeSpec, SpecialTokens
from disttrain_ds.schedule.simulate import makespan_batch

INTER_TIME_BUDGET_S = 1.0
"""Search budget of the inter-microbatch order; small batches finish far below it."""
REFINE_TIME_BUDGET_S = 1.0
"""Budget of the per-module refinement of all of a batch's DP splits; small batches finish far below it."""


def _cost_model(shape: ShapeSpec):
    return as_graph_costs(shape.cost_model)


def _per_module(per_module: np.ndarray, mb: list[list[int]], stages: list[int], deadline: float,
                labels: np.ndarray | None = None) -> list[list[int]]:
    """One microbatch's DP groups (global sample indices) refined module by module."""
    flat = [i for group in mb for i in group]
    at = {i: p for p, i in enumerate(flat)}
    classes = None if labels is None else labels[flat]
    refined = refine_split(per_module[flat], [[at[i] for i in group] for group in mb], stages, deadline=deadline,
                           classes=classes)
    return [[flat[p] for p in group] for group in refined]


def reorder_batch(samples: list[PackedSample], shape: ShapeSpec, special: SpecialTokens) -> list[PackedSample]:
    """``samples`` regrouped by DP rank and reordered by microbatch (see the module docstring)."""
    model = _cost_model(shape)
    per_module = model.costs([s.stats(shape.patch_size, special) for s in samples])  # [n, modules] forward
    return [samples[i] for i in batch_order(per_module, model, shape.dp_size, shape.micro_batch)]


def batch_order(per_module: np.ndarray, model, groups: int, per_group: int, labels: Sequence[int] | None = None,
                budget_s: float = INTER_TIME_BUDGET_S, regroup: bool = True) -> list[int]:
    """The reordered batch as positions (position ``q`` takes sample ``order[q]``) from each
    sample's forward cost per module (``[n, modules]``, ``model``: its ``GraphCosts``), ``groups``
    blocks of ``per_group`` samples per microbatch (0: one microbatch). With ``labels`` (a class
    per position, ``reorder/host.py``) every sample stays on positions of its class, and the
    order is never slower (simulated 1F1B) than no reordering. ``budget_s`` bounds each search
    (``math.inf``: iteration limits only, the same result on every machine); ``regroup`` False
    keeps the loader's microbatches (with ``labels``; whole-batch reordering always does)."""
    n = per_module.shape[0]
    slot = groups * (per_group or n // groups)
    if slot < 1 or n % slot:
        raise ValueError(f"data.reorder: global batch {n} is not a multiple of dp_size * micro_batch = {slot}")
    total = per_module.sum(axis=1) * (1.0 + model.backward_factor)
    stages = [STAGE_ROLES.index(model.role(name)) for name in model.names]
    deadline = time.perf_counter() + min(budget_s, REFINE_TIME_BUDGET_S)
    if labels is None:
        split = build_microbatches(total, groups, n // slot)
        split = [_per_module(per_module, mb, stages, deadline) for mb in split]
        return place(_in_order(per_module, model, split, budget_s), None, slot)
    lab = check_classes(labels, slot)
    identity = [[list(range(j * slot + r * (slot // groups), j * slot + (r + 1) * (slot // groups)))
                 for r in range(groups)] for j in range(n // slot)]
    best, best_span = identity, _span(per_module, model, identity)
    for sort in (False, True) if regroup else (False,):
        split = []
        for mb in host_microbatches(total, lab, slot, sort):
            local = class_lpt(total[mb], lab[:slot], groups)
            split.append(_per_module(per_module, [[mb[t] for t in g] for g in local], stages, deadline, lab))
        ordered = _in_order(per_module, model, split, budget_s / 2 if regroup else budget_s)  # two searches share it
        span = _span(per_module, model, ordered)
        if span < best_span - 1e-12 * max(1.0, best_span):
            best, best_span = ordered, span
    return place(best, lab, slot)


def _slowest(per_module: np.ndarray, split: list[list[list[int]]]) -> np.ndarray:
    """A module's time for a microbatch = its slowest DP group ``[microbatches, modules]``."""
    return np.array([[max(per_module[g, m].sum() for g in mb) for m in range(per_module.shape[1])] for mb in split])


def _in_order(per_module: np.ndarray, model, split: list, budget_s: float) -> list:
    """Microbatches in the order minimising the simulated 1F1B makespan (a stage's time = its slowest module)."""
    fwd = model.stage_times(_slowest(per_module, split))
    order = inter_microbatch_reorder(fwd, fwd * model.backward_factor, time_budget_s=budget_s)
    return [split[j] for j in order]


def _span(per_module: np.ndarray, model, split: list) -> float:
    """Simulated 1F1B makespan of the microbatches in the given order."""
    fwd = model.stage_times(_slowest(per_module, split))
    return float(makespan_batch(fwd, fwd * model.backward_factor, np.arange(len(split))[None, :])[0])

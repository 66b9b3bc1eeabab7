"""Peak memory of one rank: the formula the planner's feasibility check and the runtime's dry run
(``estimate/memory.py``) both use, written once.

A rank holding one pipeline stage of a module at (dp, tp) keeps

* weights, gradients and optimizer states of its ``params`` (the stage's parameters over TP):
  ``params / tp * (w + g + o / opt_dp)``, where ``opt_dp`` is the DP degree when the optimizer
  states are sharded over the DP group (ZeRO-1, DeepSpeed's bf16 optimizer) and 1 otherwise; a
  frozen module keeps weights only;
* activations: ``in_flight * samples * kept + samples * workspace``, ``kept`` being the per-sample
  bytes one microbatch keeps on this rank until its backward and ``workspace`` the per-sample
  bytes of one backward pass in progress (gradients of one layer's saved tensors; with activation
  checkpointing, also one recomputed block).

Tensor parallelism without sequence parallelism (the runtime's, ``parallel/tensor_parallel.py``)
splits only the tensors inside the column/row-parallel pair (q, k, v, attention output, the MLP's
hidden activations); norms' inputs, layer inputs and outputs and the loss are replicated on every
TP rank, so per-sample bytes on a rank are ``replicated + sharded / tp`` (``tp_share``).

1F1B over the chain of modules laid end to end (``ModuleGraph.stage_offsets``) keeps
``min(stages from this one to the end of the chain, microbatches per step)`` microbatches in flight
at a stage (``in_flight``): a module's own pipeline degree is not enough, every stage downstream
(the LLM's and the generators') counts. All functions work on Python numbers and numpy arrays alike.

A rank may also hold ``extra`` bytes beside its stage (a frozen model run outside the pipeline);
the peak of a module's ranks is its most loaded stage (``worst_stage_bytes``): the first stage has
the most microbatches in flight, a later one may hold more (the LLM's head on its last stage).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np


class StageBytes(NamedTuple):
    """One pipeline stage as the runtime partitions its module, at one TP degree."""

    params: float
    """Parameters of the stage's layers (before TP sharding)."""
    kept: float
    """Per-sample bytes on one TP rank one microbatch in flight keeps (what its layers save, the
    input it received, its output)."""
    workspace: float
    """Per-sample bytes on one TP rank of one backward in progress."""


StageTable = Mapping[tuple[int, int], Sequence[StageBytes]]
"""(tp, pp) -> the stages of a module split into pp stages at TP degree tp, in order."""


def tp_share(replicated: Any, sharded: Any, tp: Any) -> Any:
    """Per-sample bytes on one TP rank: the replicated part whole, the sharded part over ``tp``."""
    return replicated + sharded / tp


def in_flight(stages_to_end: Any, microbatches: Any) -> Any:
    """Microbatches 1F1B keeps in flight at a stage with ``stages_to_end`` global stages from it
    (itself included) to the end of the chain."""
    return np.minimum(stages_to_end, microbatches)


def stages_to_end(role: str, pp: Any, llm_pp: Any, gen_pp: Any) -> Any:
    """Global stages from the first stage of a module of ``role`` with ``pp`` stages to the end of
    the chain, the LLM having ``llm_pp`` and the longest generator ``gen_pp`` (0: none); what
    ``ModuleGraph.stage_offsets`` gives: an encoder's last stage sits right before the LLM, every
    generator starts right after it, and the chain ends with the longest generator."""
    if role == "encoder":
        return pp + llm_pp + gen_pp
    if role == "llm":
        return llm_pp + gen_pp
    return gen_pp


def state_bytes(params: Any, tp: Any, weight: float, grad: float, optimizer: float,
                opt_dp: Any) -> tuple[Any, Any, Any]:
    """(weights, gradients, optimizer) bytes on one rank holding ``params`` split over ``tp``;
    ``weight``, ``grad``, ``optimizer``: bytes per parameter (0 for a frozen module's last two);
    ``opt_dp``: ranks the optimizer states are sharded over (1: not sharded)."""
    shard = params / tp
    return shard * weight, shard * grad, shard * optimizer / opt_dp


def activation_bytes(kept: Any, workspace: Any, samples: Any, flight: Any) -> Any:
    """Activation bytes on one rank: ``flight`` microbatches of ``samples`` samples keeping
    ``kept`` bytes each per sample, plus one microbatch's backward ``workspace``."""
    return flight * samples * kept + samples * workspace


def with_buckets(activations: Any, bucket: Any) -> Any:
    """Activations and gradient buckets at their peak: DeepSpeed's ZeRO optimizer in a pipeline
    holds one ``bucket`` from the first backward on (beside the activations) and a second one at
    the gradient reduce, when no microbatch's activations are left."""
    return np.maximum(activations + bucket, 2 * bucket)


def rank_bytes(params: Any, tp: Any, per_param: tuple[float, float, float], opt_dp: Any,
               kept: Any, workspace: Any, samples: Any, flight: Any, bucket: Any = 0.0) -> Any:
    """Total peak bytes of one rank: ``state_bytes`` plus ``activation_bytes`` with the ZeRO
    gradient ``bucket`` bytes (``with_buckets``; 0 without ZeRO)."""
    w, g, o = state_bytes(params, tp, *per_param, opt_dp)
    return w + g + o + with_buckets(activation_bytes(kept, workspace, samples, flight), bucket)


def worst_stage_bytes(stages: StageTable, tp: Any, pp: Any, per_param: tuple[float, float, float],
                      opt_dp: Any, samples: Any, to_end: Any, microbatches: Any, bucket: Any = 0.0) -> Any:
    """Peak bytes of the most loaded rank of a module split as ``stages`` says at (``tp``, ``pp``):
    stage s of them keeps ``in_flight(to_end - s, microbatches)`` microbatches (``to_end``: global
    stages from the module's first stage to the end of the chain). Elementwise over numpy arrays;
    raises ValueError for a (tp, pp) the table lacks."""
    tp_a, pp_a = np.asarray(tp), np.asarray(pp)
    shape = np.broadcast(tp_a, pp_a, np.asarray(opt_dp), np.asarray(samples), np.asarray(to_end)).shape
    out, seen = np.zeros(shape), np.zeros(shape, dtype=bool)
    lead = (-1,) + (1,) * len(shape)  # the stages along a new first axis, broadcast over the rest
    for (t, p), rows in stages.items():
        sel = (tp_a == t) & (pp_a == p)
        if not np.any(sel):
            continue
        params, kept, workspace = (np.array(col, dtype=float).reshape(lead) for col in zip(*rows))
        s = np.arange(len(rows)).reshape(lead)
        every = rank_bytes(params, t, per_param, opt_dp, kept, workspace, samples,
                           in_flight(to_end - s, microbatches), bucket)
        worst = np.broadcast_to(np.max(np.broadcast_to(every, (len(rows), *shape)), axis=0), shape)
        out, seen = np.where(sel, worst, out), seen | sel
    if not seen.all():
        missing = sorted({(int(a), int(b)) for a, b, ok in np.broadcast(tp_a, pp_a, seen) if not ok})
        raise ValueError(f"no stage table for (tp, pp) {missing}")
    return out

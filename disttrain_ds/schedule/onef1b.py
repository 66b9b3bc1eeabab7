"""One 1F1B schedule across all modules' stages, cut into each engine's instruction stream.

All stages of all modules are laid end to end along the graph's longest path (encoder stages,
then LLM stages, then generator stages; ``ModuleGraph.stage_offsets``: a shorter encoder starts
later) and DeepSpeed's ``TrainSchedule`` is asked for this rank's global stage. That keeps the
1F1B order and its memory bound (stage s holds at most ``stages - s`` microbatches) across module
boundaries; independent per-engine schedules deadlock whenever a downstream engine has PP > 1.

The global instructions are then rewritten for one engine:
- sends/receives to a stage of the same engine stay DeepSpeed instructions (blocking, adjacent);
- the ones that cross an engine boundary become boundary instructions served by the inter-engine
  communicator (asynchronous, DP fan-in/fan-out); the activation send itself is issued right after
  the forward pass, so it overlaps the next compute;
- each engine's first and last stage load their part of the microbatch (``LoadData``);
- modules that need no backward (frozen, with nothing trainable upstream) keep forward steps only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepspeed.runtime.pipe import schedule as ds


class LoadData(ds.BufferOpInstruction):
    """Load this engine's inputs (first stage) and loss targets (last stage) for a microbatch."""


class BoundaryRecvActivation(ds.BufferOpInstruction):
    """Receive the upstream engine's output for a microbatch (fan-in over its DP replicas)."""


class BoundarySendGrad(ds.BufferOpInstruction):
    """Send the gradient of the received activation back upstream (fan-out)."""


class BoundaryRecvGrad(ds.BufferOpInstruction):
    """Receive the gradient of this engine's output from the downstream engine."""


@dataclass(frozen=True)
class StagePlace:
    """Where one rank's stage sits in the global pipeline."""

    total_stages: int
    """Stages of all modules together."""
    global_stage: int
    """This stage's index in the global pipeline."""
    first_of_engine: bool
    """This stage is its engine's first stage."""
    last_of_engine: bool
    """This stage is its engine's last stage."""
    has_upstream: bool
    """Another engine feeds this engine."""
    has_downstream: bool
    """This engine feeds another engine."""
    backward: bool
    """This engine runs backward passes (it or an engine upstream has weights that train)."""
    upstream_backward: bool
    """Some upstream engine runs backward passes (so it wants input gradients back)."""


def engine_schedule(micro_batches: int, place: StagePlace) -> list[list[ds.PipeInstruction]]:
    """The instruction steps one engine stage executes for one optimizer step."""
    sched = ds.TrainSchedule(micro_batches=micro_batches, stages=place.total_stages, stage_id=place.global_stage)
    steps: list[list[ds.PipeInstruction]] = []
    for cmds in sched:
        out: list[ds.PipeInstruction] = []
        for cmd in cmds:
            out.extend(_rewrite(cmd, place))
        steps.append(out)
    return steps


def eval_schedule(micro_batches: int, place: StagePlace) -> list[list[ds.PipeInstruction]]:
    """Forward passes only (evaluation): the same global 1F1B order with every backward,
    gradient transfer, reduction and optimizer step left out, on every engine alike. Without
    gradients nothing flows back, so activations only wait on upstream stages: no cycle to deadlock."""
    forward = replace(place, backward=False, upstream_backward=False)
    skip = (ds.ReduceGrads, ds.ReduceTiedGrads, ds.OptimizerStep)
    steps = [[c for c in cmds if not isinstance(c, skip)] for cmds in engine_schedule(micro_batches, forward)]
    return [cmds for cmds in steps if cmds]


def num_buffers(micro_batches: int, place: StagePlace) -> int:
    return ds.TrainSchedule(micro_batches, place.total_stages, place.global_stage).num_pipe_buffers()


def _rewrite(cmd: ds.PipeInstruction, p: StagePlace) -> list[ds.PipeInstruction]:
    buf = cmd.kwargs.get("buffer_id")
    if isinstance(cmd, ds.LoadMicroBatch):
        return []  # replaced by LoadData before each forward
    if isinstance(cmd, ds.ForwardPass):
        load = [LoadData(buf)] if (p.first_of_engine or p.last_of_engine) else []
        return load + [cmd]
    if isinstance(cmd, ds.RecvActivation):
        if p.first_of_engine:  # a first stage past global stage 0 without upstream (a shorter encoder)
            return [BoundaryRecvActivation(buf)] if p.has_upstream else []
        return [cmd]
    if isinstance(cmd, ds.SendActivation):
        return [] if p.last_of_engine else [cmd]  # boundary send happens in the forward pass
    if isinstance(cmd, ds.SendGrad):
        if not p.backward:
            return []
        if p.first_of_engine:
            return [BoundarySendGrad(buf)] if p.upstream_backward else []
        return [cmd]
    if isinstance(cmd, ds.RecvGrad):
        if not p.backward:
            return []
        if p.last_of_engine:  # a last stage before the global last without downstream (a shorter generator)
            return [BoundaryRecvGrad(buf)] if p.has_downstream else []
        return [cmd]
    if isinstance(cmd, ds.BackwardPass):
        return [cmd] if p.backward else []
    if isinstance(cmd, (ds.ReduceGrads, ds.ReduceTiedGrads, ds.OptimizerStep)):
        return [cmd]
    raise TypeError(f"unexpected pipeline instruction {cmd!r}")

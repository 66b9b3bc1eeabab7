"""Preemption: after SIGTERM on any rank every rank saves the step (``Checkpointing``) and stops;
and the fault injection restart tests use (``DISTTRAIN_KILL_AT``)."""

from __future__ import annotations

from disttrain_ds.runtime.preempt import injected_kill
from disttrain_ds.runtime.trainer import Callback


class PreemptionStop(Callback):
    """The loop reached a step boundary after SIGTERM: the grace period no longer applies."""

    def __init__(self, preempt):
        self.preempt = preempt

    def on_step_end(self, trainer, samples, rec) -> None:
        if trainer.stop_requested:
            self.preempt.handled()


class FaultInjection(Callback):
    """Ends this rank abruptly after the step ``DISTTRAIN_KILL_AT`` names (first launch only); last in the list."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_step_end(self, trainer, samples, rec) -> None:
        if not trainer.stop_requested:
            injected_kill(self.rank, trainer.step)


def stop_line(trainer) -> str:
    """What the logging rank says after stopping on SIGTERM (every rank has saved the step, or
    checkpoints are off)."""
    step = trainer.step
    if trainer.recipe.checkpoint.every > 0:
        return (f"preempted: checkpoint {trainer.last_checkpoint} saved at step {step}; "
                "relaunch with train.resume=auto to continue")
    return f"preempted: stopped after step {step}; no checkpoint written (checkpoint.every=0)"

"""Checkpoints every ``checkpoint.every`` steps, after the last one, and at a preemption stop."""

from __future__ import annotations

from disttrain_ds.runtime.trainer import Callback


class Checkpointing(Callback):
    """Every rank saves its share through ``checkpoint/steps.py``'s ``Checkpointer``."""

    def __init__(self, ckpt, run_dir: str):
        self.ckpt, self.run_dir = ckpt, run_dir

    def on_step_end(self, trainer, samples, rec) -> None:
        preempted = trainer.stop_requested and self.ckpt.recipe.checkpoint.every > 0
        if self.ckpt.due(trainer.step) or preempted:
            trainer.last_checkpoint = self.ckpt.save(trainer.step, trainer.source, self.run_dir)
            trainer.say(f"checkpoint {trainer.last_checkpoint} ({self.ckpt.seconds:.1f} s)")

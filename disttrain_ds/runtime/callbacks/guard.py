"""Stop on a step whose loss is not finite (``train.on_nonfinite``), after its record is written."""

from __future__ import annotations

from disttrain_ds.runtime.guards import check_finite_loss
from disttrain_ds.runtime.trainer import Callback


class NonFiniteGuard(Callback):
    """Every rank holds the same gathered loss, so every rank stops at the same step, before any save."""

    def __init__(self, policy: str):
        self.policy = policy

    def on_step_end(self, trainer, samples, rec) -> None:
        check_finite_loss(rec, trainer.step, self.policy)

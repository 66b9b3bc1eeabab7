"""Per-module DP balance of each step's samples (``balance/<module>_*``), from the cost model."""

from __future__ import annotations

from disttrain_ds.reorder.balance import balance_figures
from disttrain_ds.runtime.trainer import Callback


class Balance(Callback):
    """Adds the step's balance figures to its record (the logging rank, before ``MetricsLog``): the
    loads of each module's replicas as ``placement`` (``runtime/placement.py``) splits the step."""

    def __init__(self, placement):
        self.placement = placement

    def on_step_end(self, trainer, samples, rec) -> None:
        rec.update(balance_figures(self.placement.loads(samples)))
        rec.update(self.placement.group_figures(samples))

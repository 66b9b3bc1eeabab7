"""Per-module DP balance of each step's samples (``balance/<module>_*``), from the cost model."""

from __future__ import annotations

from disttrain_ds.reorder.balance import dp_balance, module_columns
from disttrain_ds.runtime.trainer import Callback


class Balance(Callback):
    """Adds the step's balance figures to its record (the logging rank, before ``MetricsLog``); with
    ``placement`` (``runtime/placement.py``) the loads of each module's post-balanced replicas."""

    def __init__(self, costs, spec, slot: int, dps: dict[str, int], placement=None):
        self.costs, self.spec, self.slot, self.dps, self.placement = costs, spec, slot, dps, placement
        image = spec.encoder_of("image")
        self.patch = image.patch_size if image is not None else 1
        self.columns = module_columns(costs)

    def on_step_end(self, trainer, samples, rec) -> None:
        stats = [s.stats(self.patch, self.spec.special) for s in samples]
        groups = self.placement.groups(samples) if self.placement is not None and self.placement.balanced else None
        rec.update(dp_balance(self.costs.costs(stats), self.slot, self.dps, self.columns, groups))

"""Tell the heartbeat watchdog which step this rank is in (its failure lines name it)."""

from __future__ import annotations

from disttrain_ds.runtime.trainer import Callback


class Heartbeat(Callback):
    def __init__(self, watchdog):
        self.watchdog = watchdog

    def on_step_start(self, trainer) -> None:
        self.watchdog.step = trainer.step

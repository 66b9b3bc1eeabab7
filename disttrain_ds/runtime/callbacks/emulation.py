"""Emulated-compute records (``runtime/emulate.py``) saved at the end of a run, for the simulator."""

from __future__ import annotations

import os

from disttrain_ds.runtime.trainer import Callback


class EmulationRecords(Callback):
    def __init__(self, emulator, run_dir: str, rank: int):
        self.emulator, self.run_dir, self.rank = emulator, run_dir, rank

    def on_train_end(self, trainer) -> None:
        if not trainer.preempted:
            self.emulator.save(os.path.join(self.run_dir, "emulate"), self.rank)

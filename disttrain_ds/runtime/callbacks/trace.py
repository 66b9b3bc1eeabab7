"""The per-rank timeline of the last training step (Chrome trace under ``<run dir>/trace``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as tdist

from disttrain_ds.parallel.engine import write_trace
from disttrain_ds.runtime.guards import fresh_path
from disttrain_ds.runtime.trainer import Callback


class TraceWriter(Callback):
    """Keeps the engine's spans of each training step; at the end every rank writes its last."""

    def __init__(self, engine, group, run_dir: str, rank: int, label: str):
        self.engine, self.group, self.run_dir, self.rank, self.label = engine, group, run_dir, rank, label
        self.spans: list[dict] = []  # none if a resumed run had no step left

    def on_step_end(self, trainer, samples, rec) -> None:
        self.spans = self.engine.trace

    def on_train_end(self, trainer) -> None:
        if trainer.preempted:
            return
        # Ranks agree on a time origin through the step start: same clock on one host; roughly aligned otherwise.
        origin = torch.tensor([min(sp["start"] for sp in self.spans) if self.spans else 0.0], dtype=torch.float64)
        tdist.all_reduce(origin, op=tdist.ReduceOp.MIN, group=self.group)
        trace_dir = os.path.join(self.run_dir, "trace")
        os.makedirs(trace_dir, exist_ok=True)
        # A relaunch into the same run directory (resume) keeps the traces of earlier launches.
        path = fresh_path(os.path.join(trace_dir, f"rank{self.rank}.json"))
        write_trace(self.spans, str(path), self.rank, self.label, float(origin))

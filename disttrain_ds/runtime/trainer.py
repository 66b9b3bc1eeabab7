"""The training loop every layout runs: one ``Trainer``, callbacks per concern, a step executor.

What a layout changes is how one optimizer step is executed and how its figures are gathered
(``StepExecutor``: ``runtime/reference.py`` runs the whole model in one process,
``runtime/pipeline_step.py`` this rank's pipeline stage). Everything around the step (metrics and
MFU, balance, checkpoints, the trace, emulation records, preemption, the non-finite loss guard,
evaluation) is a callback in ``runtime/callbacks/``, called in list order.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol


class StepExecutor(Protocol):
    """How one layout executes a step; every rank gets the same gathered figures back."""

    def train_step(self, step: int, samples: list, data_wait: float, t0: float) -> tuple[dict, bool]:
        """One optimizer step (0-based ``step``) over the global batch ``samples``, begun at
        ``t0`` (``time.perf_counter``); returns the step's gathered figures (losses, times) and
        whether any rank was asked to stop (SIGTERM)."""

    def evaluate(self, batches: list[list]) -> dict[str, float]:
        """Forward passes only over held-out global batches: ``eval/loss`` and ``eval/loss/<module>``
        (the mean over ``batches``), with no gradient, optimizer step or training-RNG use."""

    def finish(self) -> None:
        """After the last step: complete outstanding communication."""

    def batch_view(self, samples: list) -> list:
        """The global batch the callbacks see after a step: ``samples``, or where this host read
        only its own share, stand-ins of the others' samples on the logging rank (a collective:
        every rank calls it)."""


class Callback:
    """One concern of the training loop; every hook is optional."""

    def on_train_start(self, trainer: "Trainer") -> None:
        """Before the first step."""

    def on_step_start(self, trainer: "Trainer") -> None:
        """Before step ``trainer.step`` (1-based) reads its batch."""

    def on_step_end(self, trainer: "Trainer", samples: list, rec: dict) -> None:
        """After step ``trainer.step``: ``rec`` is its record (callbacks may add figures to it)."""

    def on_train_end(self, trainer: "Trainer") -> None:
        """After the loop, on every rank (``trainer.preempted`` says whether it stopped early)."""


class Trainer:
    """Runs ``train.steps`` steps from ``start``: batch -> executor -> callbacks, in that order."""

    def __init__(self, recipe, source, executor: StepExecutor, callbacks: list[Callback], start: int = 0,
                 echo: Callable[[str], None] | None = None, keep_records: bool = False):
        self.recipe, self.source, self.executor, self.callbacks = recipe, source, executor, callbacks
        self.start = start
        self.echo = echo
        """Where the logging rank prints lines (progress, checkpoints); None elsewhere."""
        self.step = start
        """The step being run or just finished, counted from 1."""
        self.stop_requested = False
        """Some rank got SIGTERM and steps remain: save this step and stop (``callbacks/preemption.py``)."""
        self.preempted = False
        """The loop ended early on ``stop_requested``."""
        self.last_checkpoint = None
        """Path of the newest checkpoint this run saved."""
        self.records: list[dict] = []
        """Every step's record, with ``keep_records`` (the reference trainer returns them)."""
        self._keep = keep_records

    def fit(self) -> None:
        self._call("on_train_start")
        try:
            for step in range(self.start, self.recipe.train.steps):
                self.step = step + 1
                self._call("on_step_start")
                t0 = time.perf_counter()
                samples = self.source.global_batch(step)
                figures, stop = self.executor.train_step(step, samples, self.source.last_wait_seconds, t0)
                self.stop_requested = stop and self.step < self.recipe.train.steps
                rec = {"step": self.step, **figures}
                samples = self.executor.batch_view(samples)
                self._call("on_step_end", samples, rec)
                if self._keep:
                    self.records.append(rec)
                if self.stop_requested:
                    self.preempted = True
                    break
        finally:
            self.source.close()  # stops producer processes, if any
        self.executor.finish()
        self._call("on_train_end")

    def say(self, line: str) -> None:
        """Print ``line`` on the logging rank."""
        if self.echo is not None:
            self.echo(line)

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

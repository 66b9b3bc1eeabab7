"""Step figures that need only the global batch (throughput, learning rate, data, MFU), written to
metrics.jsonl / wandb, and the progress line every ``logging.every`` steps."""

from __future__ import annotations

from typing import Callable

from ...data.types import batch_bytes
from ..rundir import progress_line
from ..setup import lr_lambda
from ..trainer import Callback


def step_tokens(samples, pad_id: int) -> int:
    """Non-padding tokens of a global batch."""
    return int(sum(int((s.input_ids != pad_id).sum()) for s in samples))


class MetricsLog(Callback):
    """Completes each step record and writes it (the logging rank only)."""

    def __init__(self, recipe, pad_id: int, writer=None, mfu=None, say: Callable[[str], None] | None = None):
        self.recipe, self.pad_id, self.writer, self.mfu, self.say = recipe, pad_id, writer, mfu, say
        self.lr = lr_lambda(recipe)

    def on_step_end(self, trainer, samples, rec) -> None:
        seconds = rec["step_seconds"]
        tokens = step_tokens(samples, self.pad_id)
        rec.update({
            "samples_per_s": len(samples) / seconds,
            "tokens_per_s": tokens / seconds,
            "perf/tokens_per_s": tokens / seconds,
            "lr": self.recipe.optim.lr * self.lr(trainer.step - 1),
            "data/batch_mib": batch_bytes(samples) / 2**20,
            **{f"data/skipped/{k}": v for k, v in trainer.source.skip_counts().items()},
        })
        if self.mfu is not None:
            rec.update(self.mfu(samples, seconds))
        if self.writer is not None:
            self.writer.log(rec)
        if self.say is not None and trainer.step % self.recipe.logging.every == 0:
            self.say(progress_line(rec))

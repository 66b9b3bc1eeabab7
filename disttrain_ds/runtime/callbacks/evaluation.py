"""Validation loss every ``eval.every`` steps on the held-out split (``data/split.py``).

The held-out batches come from their own source, so the training source's order and state are
untouched; the executor runs forward passes only (no gradients, no optimizer step, no training
RNG), so a run with evaluation has the same training losses as one without.
"""

from __future__ import annotations

from disttrain_ds.runtime.trainer import Callback


def eval_due(step: int, every: int, steps: int) -> bool:
    """Whether to evaluate after ``step`` optimizer steps (every ``every``, and after the last)."""
    return every > 0 and (step % every == 0 or step == steps)


class Evaluation(Callback):
    """Adds ``eval/loss`` and ``eval/loss/<module>`` to the records of the steps it runs after."""

    def __init__(self, recipe, source):
        self.every, self.batches, self.steps = recipe.eval.every, recipe.eval.batches, recipe.train.steps
        self.source = source
        """The held-out source (``runtime/setup.py: build_eval_source``)."""

    def on_step_end(self, trainer, samples, rec) -> None:
        if eval_due(trainer.step, self.every, self.steps):
            held_out = [self.source.global_batch(b) for b in range(self.batches)]
            rec.update(trainer.executor.evaluate(held_out))

    def on_train_end(self, trainer) -> None:
        self.source.close()


def eval_figures(lm: float, gens: dict[str, float], spec) -> dict[str, float]:
    """The evaluation record of mean held-out LM and diffusion losses, per module by name (their sum
    is ``eval/loss``, the same sum as the step's ``loss``); ``gens``: each generator's loss."""
    out = {"eval/loss": lm + sum(gens.values(), 0.0), f"eval/loss/{spec.name_of('llm')}": lm}
    out.update({f"eval/loss/{name}": gens[name] for name in spec.generators})
    return out

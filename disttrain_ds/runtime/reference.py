"""``layout: reference``: the whole MLLM in one process, no pipeline.

Same initial weights, same data order, same loss normalisation and optimizer as the distributed
layouts: the ground truth they are tested against, and the simplest thing a user can run. It runs
through the same ``Trainer`` and callbacks as the pipeline layouts; ``ReferenceExecutor`` is what
differs (the whole model steps in this process, nothing to gather).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from disttrain_ds.metrics.logger import RunLogger
from disttrain_ds.metrics.step_flops import MfuMeter
from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate
from disttrain_ds.models.compiled import compile_enabled, compile_layers, graphs_compiled
from disttrain_ds.models.vae import generator_vae
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.runtime.callbacks.evaluation import Evaluation, eval_figures
from disttrain_ds.runtime.callbacks.guard import NonFiniteGuard
from disttrain_ds.runtime.callbacks.metrics import MetricsLog
from disttrain_ds.runtime.setup import (
    build_data_and_spec,
    build_eval_source,
    build_optimizer,
    grad_accum_steps,
    lr_lambda,
    param_groups,
)
from disttrain_ds.runtime.trainer import Trainer


class ReferenceExecutor:
    """Executes a step of the whole model in one process, in LLM-microbatch chunks."""

    def __init__(self, recipe: Recipe, spec, model: ReferenceMLLM):
        self.recipe, self.spec, self.model = recipe, spec, model
        self.dtype = compute_dtype(recipe)
        self.chunks = grad_accum_steps(recipe) * recipe.parallel.llm.dp
        self.vae = generator_vae(spec)  # targets travel as pixels: encoded here, ahead of the generator
        self.optimizers = {
            name: build_optimizer(recipe, param_groups(
                recipe, name, [(d.name, layer) for d, layer in zip(spec.layers(name), getattr(model, name).layers)]))
            for name in spec.names
            if not spec.frozen(name)
        }
        self.schedulers = {n: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(recipe)) for n, o in self.optimizers.items()}

    def _losses(self, samples: list, backward: bool) -> dict[str, float]:
        """The global batch's losses (``loss``, ``lm``, ``gen``, ``gen/<generator>``), summed over its chunks."""
        m = self.recipe.train.micro_batch
        norms = BatchNorms.of(samples, self.chunks, len(self.spec.generators))
        totals = {"loss": 0.0, "lm": 0.0, "gen": 0.0, **{f"gen/{n}": 0.0 for n in self.spec.generators}}
        for c in range(self.chunks):
            mb = collate(samples[c * m : (c + 1) * m], norms, self.spec, dtype=self.dtype, vae=self.vae)
            out = self.model(mb)
            if backward:
                (out["loss"] / self.chunks).backward()
            for k in totals:
                totals[k] += float(out[k].detach()) / self.chunks
        return totals

    def train_step(self, step: int, samples: list, data_wait: float, t0: float) -> tuple[dict, bool]:
        totals = self._losses(samples, backward=True)
        for name, opt in self.optimizers.items():
            if self.recipe.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(getattr(self.model, name).parameters(), self.recipe.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.schedulers[name].step()
        dt = time.perf_counter() - t0
        return {"loss": totals["loss"], "loss/lm": totals["lm"], "loss/gen": totals["gen"], "step_seconds": dt,
                "time/step": dt, "time/data_wait": data_wait,
                **{f"loss/gen/{n}": totals[f"gen/{n}"] for n in self.spec.generators},
                **({"compile/graphs": graphs} if (graphs := graphs_compiled()) else {})}, False

    def evaluate(self, batches: list[list]) -> dict[str, float]:
        with torch.no_grad():
            per_batch = [self._losses(samples, backward=False) for samples in batches]
        mean = {k: sum(t[k] for t in per_batch) / len(batches) for k in per_batch[0]}
        return eval_figures(mean["lm"], {n: mean[f"gen/{n}"] for n in self.spec.generators}, self.spec)

    def batch_view(self, samples: list) -> list:
        return samples  # one process reads the whole batch

    def finish(self) -> None:
        pass


def train_reference(recipe: Recipe, run_dir: Path | None, log=print) -> tuple[list[dict], ReferenceMLLM]:
    """Train for ``train.steps`` optimizer steps; returns the per-step records and the model.

    Raises ``errors.TrainingDiverged`` after logging a step whose loss is not finite (unless
    ``train.on_nonfinite`` is ``continue``)."""
    torch.manual_seed(recipe.seed)
    source, spec = build_data_and_spec(recipe)
    model = ReferenceMLLM(spec)
    model.to(compute_dtype(recipe))
    if compile_enabled(recipe.train.compile, torch.device("cpu")):  # the reference runs on the CPU
        compile_layers(layer for name in spec.names for layer in getattr(model, name).layers)
    executor = ReferenceExecutor(recipe, spec, model)  # optimizers over the converted parameters
    writer = RunLogger.from_recipe(run_dir, recipe) if run_dir else None
    # One process holds every module: each module's MFU is over the one device.
    mfu = MfuMeter(spec, {m: 1 for m in spec.names}, 1, recipe.train.peak_tflops, device_name=None) if run_dir else None
    if mfu and log:
        log(f"MFU peak: {mfu.peak:.3g} TFLOP/s ({mfu.peak_source})")
    say = (writer.echo if writer else log) if log else None
    callbacks = [MetricsLog(recipe, spec.special.pad, writer, mfu, say), NonFiniteGuard(recipe.train.on_nonfinite)]
    if recipe.eval.every > 0:
        callbacks.insert(0, Evaluation(recipe, build_eval_source(recipe)))
    trainer = Trainer(recipe, source, executor, callbacks, echo=say, keep_records=True)
    try:
        trainer.fit()
    finally:
        if writer:
            writer.close()
    return trainer.records, model


def compute_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype of the model's weights and inputs (``train.dtype``)."""
    return torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32


def reference_layer_state(model: ReferenceMLLM) -> dict[str, torch.Tensor]:
    """Parameters keyed ``module/layer/param``, comparable with the distributed export."""
    out = {}
    for module in model.spec.names:
        defs = model.spec.layers(module)
        for d, layer in zip(defs, getattr(model, module).layers):
            for k, v in layer.state_dict().items():
                out[f"{module}/{d.name}/{k}"] = v.detach().cpu().clone()
    return out

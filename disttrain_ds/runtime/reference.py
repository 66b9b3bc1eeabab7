"""``layout: reference``: the whole MLLM in one process, no pipeline.

Same initial weights, same data order, same loss normalisation and optimizer as the distributed
layouts: the ground truth they are tested against, and the simplest thing a user can run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Recipe
from ..data.types import batch_bytes
from ..models.mllm import BatchNorms, ReferenceMLLM, collate
from ..metrics.logger import RunLogger
from ..metrics.step_flops import MfuMeter
from .guards import check_finite_loss
from .rundir import progress_line
from .setup import build_data_and_spec, build_optimizer, grad_accum_steps, lr_lambda, param_groups


def step_tokens(samples, pad_id: int) -> int:
    return int(sum(int((s.input_ids != pad_id).sum()) for s in samples))


def train_reference(recipe: Recipe, run_dir: Path | None, log=print) -> tuple[list[dict], ReferenceMLLM]:
    """Train for ``train.steps`` optimizer steps; returns the per-step records and the model.

    Raises ``guards.TrainingDiverged`` after logging a step whose loss is not finite (unless
    ``train.on_nonfinite`` is ``continue``)."""
    torch.manual_seed(recipe.seed)
    source, spec = build_data_and_spec(recipe)
    model = ReferenceMLLM(spec)
    dtype = torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32
    model.to(dtype)
    optimizers = {
        name: build_optimizer(recipe, param_groups(
            recipe, name, [(d.name, layer) for d, layer in zip(spec.layers(name), getattr(model, name).layers)]))
        for name in spec.names
        if not spec.frozen(name)
    }
    schedulers = {n: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(recipe)) for n, o in optimizers.items()}
    writer = RunLogger.from_recipe(run_dir, recipe) if run_dir else None
    # One process holds every module: each module's MFU is over the one device.
    mfu = MfuMeter(spec, {m: 1 for m in spec.names}, 1, recipe.train.peak_tflops, device_name=None) if run_dir else None
    if mfu and log:
        log(f"MFU peak: {mfu.peak:.3g} TFLOP/s ({mfu.peak_source})")
    records: list[dict] = []
    try:
        for step in range(recipe.train.steps):
            rec, samples = _train_step(recipe, step, source, spec, model, optimizers, schedulers, dtype)
            if mfu:
                rec.update(mfu(samples, rec["step_seconds"]))
            records.append(rec)
            if writer:
                writer.log(rec)
            if log and (step + 1) % recipe.logging.every == 0:
                (writer.echo if writer else log)(progress_line(rec))
            check_finite_loss(rec, step + 1, recipe.train.on_nonfinite)
    finally:
        source.close()  # stops producer processes, if any
        if writer:
            writer.close()
    return records, model


def _train_step(recipe, step, source, spec, model, optimizers, schedulers, dtype) -> tuple[dict, list]:
    """One optimizer step over the global batch, in LLM-microbatch chunks; returns its record and samples."""
    t0 = time.perf_counter()
    m = recipe.train.micro_batch
    chunks = grad_accum_steps(recipe) * recipe.parallel.llm.dp
    samples = source.global_batch(step)
    norms = BatchNorms.of(samples, chunks)
    totals = {"loss": 0.0, "lm": 0.0, "gen": 0.0}
    for c in range(chunks):
        mb = collate(samples[c * m : (c + 1) * m], norms, spec, dtype=dtype)
        out = model(mb)
        (out["loss"] / chunks).backward()
        for k in totals:
            totals[k] += float(out[k].detach()) / chunks
    for name, opt in optimizers.items():
        if recipe.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(getattr(model, name).parameters(), recipe.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedulers[name].step()
    dt = time.perf_counter() - t0
    return {
        "step": step + 1,
        "loss": totals["loss"],
        "loss/lm": totals["lm"],
        "loss/gen": totals["gen"],
        "step_seconds": dt,
        "samples_per_s": len(samples) / dt,
        "tokens_per_s": step_tokens(samples, spec.special.pad) / dt,
        "perf/tokens_per_s": step_tokens(samples, spec.special.pad) / dt,
        "time/step": dt,
        "lr": recipe.optim.lr * lr_lambda(recipe)(step),
        "time/data_wait": source.last_wait_seconds,
        "data/batch_mib": batch_bytes(samples) / 2**20,
        **{f"data/skipped/{k}": v for k, v in source.skip_counts().items()},
    }, samples


def reference_layer_state(model: ReferenceMLLM) -> dict[str, torch.Tensor]:
    """Parameters keyed ``module/layer/param``, comparable with the distributed export."""
    out = {}
    for module in model.spec.names:
        defs = model.spec.layers(module)
        for d, layer in zip(defs, getattr(model, module).layers):
            for k, v in layer.state_dict().items():
                out[f"{module}/{d.name}/{k}"] = v.detach().cpu().clone()
    return out

"""Step figures that need only the global batch (throughput, learning rate, data, MFU), written to
metrics.jsonl / wandb, and the progress line every ``logging.every`` steps."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from disttrain_ds.checkpoint.lock import hold
from disttrain_ds.metrics.logger import RunLogger
from disttrain_ds.metrics.rundir import make_run_dir, progress_line, reopen_run_dir, write_resolved_recipe
from disttrain_ds.metrics.step_flops import MfuMeter
from disttrain_ds.runtime.setup import lr_lambda
from disttrain_ds.runtime.trainer import Callback
from disttrain_ds.samples import batch_bytes


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


def open_pipeline_run(recipe, topo, world: int, device, spec, source, resume, log, out):
    """The logging rank of a pipeline layout: its run directory (new, or the checkpoint's reopened
    after ``resume = (path, manifest, step)``), the metrics writer (terminal ``out``), the MFU meter
    and this job's lock on the run directory (taken before anything in it is touched)."""
    resume_from, manifest, start = resume
    resolved = {"world_size": world, "topology": topo.describe()}
    timeout = recipe.checkpoint.lock_timeout_s
    if manifest is not None:
        lock = hold(manifest["run_dir"], "run directory", timeout, log)
        run_dir, moved = reopen_run_dir(Path(manifest["run_dir"]), start)
        write_resolved_recipe(run_dir, recipe, {**resolved, "resumed_from": str(resume_from)}, f"recipe.resume{start}.yaml")
        log(f"resumed from {resume_from} at step {start}" + (f"; {moved} later step records moved to metrics.rolled_back.jsonl" if moved else ""))
    else:
        run_dir = make_run_dir(recipe.logging.dir, recipe.name)
        lock = hold(run_dir, "run directory", timeout, log)
        write_resolved_recipe(run_dir, recipe, resolved)
    writer = RunLogger.from_recipe(run_dir, recipe, resolved=resolved, out=out)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    gpus = {m.name: m.size for m in topo.modules}
    mfu = MfuMeter(spec, gpus, topo.world_size, recipe.train.peak_tflops, device_name)
    log(f"MFU peak: {mfu.peak:.3g} TFLOP/s per rank ({mfu.peak_source})")
    log(f"recipe {recipe.source_file}: layout {recipe.layout}, {recipe.train.steps} steps, run dir {run_dir}")
    log(f"data: {source.describe()}")
    return run_dir, writer, mfu, lock

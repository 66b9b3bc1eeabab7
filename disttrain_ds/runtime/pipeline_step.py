"""The pipeline layouts' step executor: this rank's microbatches through its engine, figures
gathered from every rank (``runtime/trainer.py`` runs the loop around it)."""

from __future__ import annotations

import time

import torch

from ..comm.routes import blocks
from ..models.mllm import BatchNorms, collate
from ..models.vae import generator_vae
from .callbacks.evaluation import eval_figures
from .setup import grad_accum_steps
from .step_record import gather_losses, gather_step_record


class PipelineExecutor:
    """Every rank asks the source for the whole global batch and keeps its own samples: microbatch
    slot g holds ``DP_llm x micro_batch`` samples, split into contiguous blocks over this module's
    DP replicas."""

    def __init__(self, recipe, topo, grid, place, tp_index: int, dp_index: int, spec, engine, p2p, group, preempt):
        self.topo, self.grid, self.place, self.tp_index, self.spec = topo, grid, place, tp_index, spec
        self.engine, self.p2p, self.group, self.preempt = engine, p2p, group, preempt
        self.gas = grad_accum_steps(recipe)
        self.slot = recipe.parallel.llm.dp * recipe.train.micro_batch
        self.chunks = self.gas * recipe.parallel.llm.dp
        self.block = blocks(self.slot, grid.dp)[dp_index]
        self.dtype = torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32
        llm_dp = topo.module(spec.name_of("llm")).dp
        self.gen_dp_scale = {g: topo.module(g).dp / llm_dp for g in spec.generators}  # each generator's DP / the LLM's
        # vae.placement generator: the first generator's first stage encodes its targets (forward only, frozen).
        gen = spec.name_of("generator")
        self.vae = generator_vae(spec) if grid.name == gen and place.first_of_engine else None

    def _mine(self, samples: list) -> list[list]:
        """This rank's samples of each microbatch slot."""
        return [samples[g * self.slot : (g + 1) * self.slot][self.block.start : self.block.stop] for g in range(self.gas)]

    def _batches(self, samples: list) -> list:
        norms = BatchNorms.of(samples, self.chunks, len(self.spec.generators))  # global-batch totals: losses independent of the split
        return [collate(mine, norms, self.spec, gen_dp_scale=self.gen_dp_scale, dtype=self.dtype, vae=self.vae)
                for mine in self._mine(samples)]

    def train_step(self, step: int, samples: list, data_wait: float, t0: float) -> tuple[dict, bool]:
        batches = self._batches(samples)
        if self.engine.emulator is not None:
            self.engine.emulator.set_step(step, self._mine(samples), t0)
        stats = self.engine.run_step(batches)
        stats["data_wait_s"] = data_wait
        elapsed = time.perf_counter() - t0
        rec = gather_step_record(self.topo, self.grid, self.place, self.tp_index, stats, elapsed, self.chunks,
                                 self.gen_dp_scale, self.group, self.preempt.requested, self.spec.roles)
        return rec, rec.pop("preempt")  # any rank got SIGTERM

    def evaluate(self, batches: list[list]) -> dict[str, float]:
        # Forward only through the same engines and boundary links as training (ModuleEngine.run_eval).
        own = sum(self.engine.run_eval(self._batches(samples))["own_loss"] for samples in batches)
        lm, gens = gather_losses(self.topo, self.grid, self.place, self.tp_index, own / len(batches), self.chunks,
                                self.gen_dp_scale, self.group, self.spec.roles)
        return eval_figures(lm, gens, self.spec)

    def finish(self) -> None:
        self.p2p.flush_sends()

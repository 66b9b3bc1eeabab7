"""The pipeline layouts' step executor: this rank's microbatches through its engine, figures
gathered from every rank (``runtime/trainer.py`` runs the loop around it)."""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from disttrain_ds.comm.routes import blocks
from disttrain_ds.data.outline import fill_in, outline
from disttrain_ds.mllm.model import BatchNorms, collate
from disttrain_ds.models.vae import generator_vae
from disttrain_ds.parallel.sequence_parallel import SPContext
from disttrain_ds.runtime.callbacks.evaluation import eval_figures
from disttrain_ds.runtime.placement import Placement, carriers
from disttrain_ds.runtime.rank_context import RankContext
from disttrain_ds.runtime.setup import grad_accum_steps
from disttrain_ds.runtime.step_record import gather_losses, gather_step_record


class PipelineExecutor:
    """Every rank asks the source for the global batch and keeps its own samples: microbatch
    slot g holds ``DP_llm x micro_batch`` samples, split into contiguous blocks over this module's
    DP replicas. With ``counted`` (``data.read: host``) this host holds only the samples of its
    own ranks (None elsewhere): the batch-wide counts are summed over the ranks, each position
    counted by one rank (``counted`` lists this rank's)."""

    def __init__(self, ctx: RankContext, spec, engine, preempt, counted: list[int] | None = None,
                 homes: dict[str, list[frozenset[str]]] | None = None):
        """``homes``: with ``counted``, the hosts of every module's replicas (``Placement``)."""
        recipe, topo, grid, place = ctx.recipe, ctx.topo, ctx.grid, ctx.place
        self.ctx, self.counted, self.spec, self.engine, self.preempt = ctx, counted, spec, engine, preempt
        self.grid, self.group = grid, ctx.meta_group
        self.gas = grad_accum_steps(recipe)
        self.slot = ctx.slot
        self.chunks = self.gas * recipe.parallel.llm.dp
        self.block = blocks(self.slot, grid.dp)[ctx.dp_index]
        self.placement = Placement(recipe, spec, {m.name: m.dp for m in topo.modules}, homes,
                                   adaptive=[m.name for m in topo.modules if m.sp_auto], per_node=ctx.per_node)
        # Adaptive SP: this rank's groups (first data index, size) -> (ranks, handle), made at start.
        self.sp_handles = ctx.groups.adaptive_groups(grid.name) if grid.sp_auto else None
        self._shared: tuple[list, list] | None = None  # (a step's samples, every rank's outlines of them)
        self.dtype = torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32
        llm_dp = topo.module(spec.name_of("llm")).dp
        self.gen_dp_scale = {g: topo.module(g).dp / llm_dp for g in spec.generators}  # each generator's DP / the LLM's
        # vae.placement generator: the first generator's first stage encodes its targets (forward
        # only, frozen) on its own device: batched in the compute dtype on a GPU, per image in fp32 on CPU.
        on_gen = bool(spec.generators) and grid.name == spec.generators[0] and place.first_of_engine
        self.vae = generator_vae(spec, str(getattr(engine, "device", "cpu")), self.dtype) if on_gen else None

    def _place(self, samples: list) -> None:
        """This step's samples and units of each module's replicas; the boundaries route by them.
        Post-balancing with ``data.read: host`` prices the samples other hosts read by their outlines."""
        view = self._everyone(samples) if self.counted is not None and self.placement.balanced else samples
        self.plans = self.placement.plans(view)
        if self.sp_handles is not None:
            self.engine.sp_groups = [self._sp_context(plan) for plan in self.plans]
        self.owners = {}  # (upstream, downstream) -> per microbatch, each unit's replica on either side
        for comm in (*self.engine.upstreams, *self.engine.downstreams):
            edge = (comm.up.name, comm.down.name)
            self.owners[edge] = [plan.edge_owners(*edge) for plan in self.plans]
            comm.set_owners(self.owners[edge])

    def _group_of(self, plan) -> tuple[int, int, tuple[int, ...]]:
        """This rank's adaptive SP group in a slot: (first data index, size, sample positions)."""
        d = self.ctx.dp_index
        return next(g for g in plan.groups[self.grid.name] if g[0] <= d < g[0] + g[1])

    def _sp_context(self, plan) -> SPContext | None:
        first, size, _ = self._group_of(plan)
        if size == 1:
            return None
        ranks, handle = self.sp_handles[(first, size)]
        return SPContext(handle, self.ctx.dp_index - first, size, ranks[0], adaptive=True)

    def _peers(self) -> dict[str, list[list[int]]] | None:
        """With post-balancing, per module across this rank's boundaries, per microbatch, the
        replicas of it this replica exchanges units with (for the emulation's record)."""
        if not self.placement.balanced:
            return None
        me, dp, out = self.grid.name, self.ctx.dp_index, {}
        for (up, down), pairs in self.owners.items():
            other, (mine, theirs) = (up, (1, 0)) if down == me else (down, (0, 1))
            out[other] = [sorted({o[theirs][u] for u in range(len(o[0])) if o[mine][u] == dp}) for o in pairs]
        return out

    def _mine(self, samples: list) -> list[list]:
        """This rank's samples of each microbatch slot (in slot order); an encoder's or generator's:
        the samples it holds units of, with only those units."""
        me, dp = self.grid.name, self.ctx.dp_index
        if me in self.plans[0].groups:  # adaptive SP: what this rank's group holds, on every member
            if me in self.plans[0].units:  # an encoder's units
                return [carriers(samples, g * self.slot, list(self._group_of(plan)[2]), self.slot, self.spec, me)
                        for g, plan in enumerate(self.plans)]
            return [[samples[g * self.slot + p] for p in self._group_of(plan)[2]] for g, plan in enumerate(self.plans)]
        if me in self.plans[0].units:
            return [carriers(samples, g * self.slot, plan.units[me][dp], self.slot, self.spec, me)
                    for g, plan in enumerate(self.plans)]
        return [[samples[g * self.slot + p] for p in plan.samples[me][dp]] for g, plan in enumerate(self.plans)]

    def _check_read(self, samples: list) -> None:
        """Every sample this rank consumes or counts was read on this host (one line if not)."""
        mine = {g * self.slot + p for g in range(self.gas) for p in self.block} | set(self.counted or ())
        me = self.grid.name
        if me in self.plans[0].units:  # post-balanced: the samples of the units it holds
            mine |= {g * self.slot + p for g, plan in enumerate(self.plans) for p, _ in plan.units[me][self.ctx.dp_index]}
        missing = sorted(p for p in mine if samples[p] is None)
        if missing:
            raise RuntimeError(f"data.read: this host did not read samples {missing[:4]} of the global batch that "
                               f"this rank ({self.grid.name}, dp block {self.block.start}..{self.block.stop - 1} "
                               "of each slot) consumes or counts")

    def _norms(self, samples: list) -> BatchNorms:
        """Global-batch totals (losses independent of the split), summed over the hosts when each read a share."""
        if self.counted is None:
            return BatchNorms.of(samples, self.chunks, len(self.spec.generators))
        mine = [samples[p] for p in self.counted]
        counts = torch.tensor(BatchNorms.counts(mine, len(self.spec.generators)), dtype=torch.long)
        tdist.all_reduce(counts, group=self.group)
        return BatchNorms.of_counts(counts.tolist(), self.chunks)

    def _batches(self, mine: list[list], norms: BatchNorms) -> list:
        """Each microbatch's module inputs from this rank's samples of it (``_mine``)."""
        return [collate(part, norms, self.spec, gen_dp_scale=self.gen_dp_scale, dtype=self.dtype, vae=self.vae)
                for part in mine]

    def _everyone(self, samples: list) -> list:
        """The global batch on every rank: the samples this host read and stand-ins of the others'
        (their outlines, gathered from the ranks that count them)."""
        if self._shared is None or self._shared[0] is not samples:
            mine = [(p, outline(samples[p], self.spec.special)) for p in self.counted]
            got = [None] * tdist.get_world_size()
            tdist.all_gather_object(got, mine, group=self.group)
            self._shared = (samples, fill_in(samples, (item for part in got for item in part), self.spec.special))
        return self._shared[1]

    def batch_view(self, samples: list) -> list:
        """The global batch for the step's figures: on the logging rank (0), the samples it read
        and stand-ins (counts and shapes, ``data/outline.py``) of those other hosts read."""
        if self.counted is None:
            return samples
        if self._shared is not None and self._shared[0] is samples:  # every rank already has them
            return self._shared[1]
        mine = [(p, outline(samples[p], self.spec.special)) for p in self.counted]
        rank = tdist.get_rank()
        got = [None] * tdist.get_world_size() if rank == 0 else None
        tdist.gather_object(mine, got, dst=0, group=self.group)
        if rank != 0:
            return samples
        return fill_in(samples, (item for part in got for item in part), self.spec.special)

    def train_step(self, step: int, samples: list, data_wait: float, t0: float) -> tuple[dict, bool]:
        self._place(samples)
        if self.counted is not None:
            self._check_read(samples)
        mine = self._mine(samples)
        batches = self._batches(mine, self._norms(samples))
        if self.engine.emulator is not None:
            self.engine.emulator.set_step(step, mine, t0, self._peers())
        stats = self.engine.run_step(batches)
        stats["data_wait_s"] = data_wait
        elapsed = time.perf_counter() - t0
        rec = gather_step_record(self.ctx, stats, elapsed, self.chunks, self.gen_dp_scale, self.preempt.requested,
                                 self.spec.roles)
        return rec, rec.pop("preempt")  # any rank got SIGTERM

    def evaluate(self, batches: list[list]) -> dict[str, float]:
        # Forward only through the same engines and boundary links as training (ModuleEngine.run_eval).
        # Held-out batches are read whole by every rank (``build_eval_source``).
        norms = [BatchNorms.of(samples, self.chunks, len(self.spec.generators)) for samples in batches]
        own = 0.0
        for samples, n in zip(batches, norms):
            self._place(samples)
            own += self.engine.run_eval(self._batches(self._mine(samples), n))["own_loss"]
        lm, gens = gather_losses(self.ctx, own / len(batches), self.chunks, self.gen_dp_scale, self.spec.roles)
        return eval_figures(lm, gens, self.spec)

    def finish(self) -> None:
        self.ctx.p2p.flush_sends()

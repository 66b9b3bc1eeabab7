"""One optimizer step's figures, gathered from every rank: losses, times, memory, preemption."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from disttrain_ds.graph import MODULES
from disttrain_ds.models.compiled import graphs_compiled
from disttrain_ds.runtime.rank_context import RankContext


def gather_step_record(ctx: RankContext, stats: dict, elapsed: float, chunks: int, gen_dp_scale,
                       preempt: bool = False, roles: dict[str, str] | None = None) -> dict:
    """All ranks contribute their figures; every rank gets the step record (rank 0 writes it).
    ``preempt``: this rank got SIGTERM; the record's ``preempt`` is whether any rank did.
    ``roles``: module name -> role in data-flow order (default: the three-module graph)."""
    roles = roles or dict(zip(MODULES, MODULES))
    names = list(roles)
    mine = torch.tensor(
        [
            names.index(ctx.grid.name),
            1.0 if ctx.place.last_of_engine and ctx.tp_index == 0 else 0.0,  # TP ranks hold the same loss
            stats["own_loss"],
            elapsed,
            stats["compute_s"],
            stats["comm_wait_s"],
            stats["data_wait_s"],
            peak_memory_gib(),
            1.0 if preempt else 0.0,
            graphs_compiled(),
        ],
        dtype=torch.float64,
    )
    table = _gather_rows(mine, ctx.topo.world_size, ctx.meta_group)
    lm, gens = _module_losses(table, roles, chunks, gen_dp_scale)
    gen = sum(gens.values(), 0.0)
    step = float(table[:, 3].max())
    # Idle time per rank that is neither its compute nor a boundary/data wait: pipeline bubbles
    # (including waits on DeepSpeed's intra-engine P2P) and bookkeeping.
    idle = step - table[:, 4] - table[:, 5] - table[:, 6]
    rec = {
        "loss": lm + gen,
        "loss/lm": lm,
        "loss/gen": gen,
        "step_seconds": step,
        "time/step": step,
        "time/data_wait": float(table[:, 6].max()),
        "time/comm_wait": float(table[:, 5].mean()),
        "time/bubble": float(idle.clamp(min=0).mean()),
        "preempt": bool(table[:, 8].max() > 0),
        **{f"loss/gen/{name}": value for name, value in gens.items()},
    }
    if table[:, 9].sum() > 0:  # train.compile: graphs made so far over all ranks (growing after warm-up: recompiles)
        rec["compile/graphs"] = int(table[:, 9].sum())
    for i, name in enumerate(names):
        sel = table[table[:, 0] == i]
        rec[f"time/{name}_compute"] = float(sel[:, 4].max())
        rec[f"time/{name}_comm_wait"] = float(sel[:, 5].max())
        rec[f"memory/{name}_peak_gib"] = float(sel[:, 7].max())
    return rec


def gather_losses(ctx: RankContext, own_loss: float, chunks: int, gen_dp_scale,
                  roles: dict[str, str]) -> tuple[float, dict[str, float]]:
    """(LM loss, diffusion loss per generator) of one global batch from every rank's ``own_loss``,
    normalised as in the step record (evaluation; every rank calls it and gets the same figures)."""
    holder = 1.0 if ctx.place.last_of_engine and ctx.tp_index == 0 else 0.0
    mine = torch.tensor([list(roles).index(ctx.grid.name), holder, own_loss], dtype=torch.float64)
    return _module_losses(_gather_rows(mine, ctx.topo.world_size, ctx.meta_group), roles, chunks, gen_dp_scale)


def _gather_rows(mine: torch.Tensor, world: int, group) -> torch.Tensor:
    rows = [torch.zeros_like(mine) for _ in range(world)]
    tdist.all_gather(rows, mine, group=group)
    return torch.stack(rows)


def _module_losses(table: torch.Tensor, roles: dict[str, str], chunks: int,
                   gen_dp_scale: float | dict[str, float]) -> tuple[float, dict[str, float]]:
    """Columns: module index, whether the rank holds its module's loss (last stage, TP index 0), own loss.
    Each generator's loss weights carry its DP_generator / DP_llm (``collate``): divided out here.
    Returns the LM loss and each generator's diffusion loss by module name."""
    names = list(roles)

    def loss_of(name: str) -> float:
        return float(table[(table[:, 0] == names.index(name)) & (table[:, 1] == 1), 2].sum())

    scale = gen_dp_scale if isinstance(gen_dp_scale, dict) else {n: gen_dp_scale for n in names}
    llm = next(n for n, r in roles.items() if r == "llm")
    gens = {n: loss_of(n) / chunks / scale[n] for n, r in roles.items() if r == "generator"}
    return loss_of(llm) / chunks, gens


def peak_memory_gib() -> float:
    """Peak device memory of this rank: CUDA allocator peak, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB

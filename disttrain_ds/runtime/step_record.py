"""One optimizer step's figures, gathered from every rank: losses, times, memory, preemption."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from ..models.mllm import MODULES


def gather_step_record(topo, grid, place, tp_index, stats, elapsed, chunks, gen_dp_scale, group,
                       preempt: bool = False, roles: dict[str, str] | None = None) -> dict:
    """All ranks contribute their figures; every rank gets the step record (rank 0 writes it).
    ``preempt``: this rank got SIGTERM; the record's ``preempt`` is whether any rank did.
    ``roles``: module name -> role in data-flow order (default: the three-module graph)."""
    roles = roles or dict(zip(MODULES, MODULES))
    names = list(roles)
    mine = torch.tensor(
        [
            names.index(grid.name),
            1.0 if place.last_of_engine and tp_index == 0 else 0.0,  # TP ranks hold the same loss
            stats["own_loss"],
            elapsed,
            stats["compute_s"],
            stats["comm_wait_s"],
            stats["data_wait_s"],
            peak_memory_gib(),
            1.0 if preempt else 0.0,
        ],
        dtype=torch.float64,
    )
    rows = [torch.zeros_like(mine) for _ in range(topo.world_size)]
    tdist.all_gather(rows, mine, group=group)
    table = torch.stack(rows)
    def loss_of(role: str) -> float:
        picked = [names.index(n) for n, r in roles.items() if r == role]
        return sum(float(table[(table[:, 0] == i) & (table[:, 1] == 1), 2].sum()) for i in picked)

    lm = loss_of("llm") / chunks
    gen = loss_of("generator") / chunks / gen_dp_scale
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
    }
    for i, name in enumerate(names):
        sel = table[table[:, 0] == i]
        rec[f"time/{name}_compute"] = float(sel[:, 4].max())
        rec[f"time/{name}_comm_wait"] = float(sel[:, 5].max())
        rec[f"memory/{name}_peak_gib"] = float(sel[:, 7].max())
    return rec


def peak_memory_gib() -> float:
    """Peak device memory of this rank: CUDA allocator peak, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB

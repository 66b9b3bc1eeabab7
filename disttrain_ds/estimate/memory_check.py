"""Holding a recipe's memory estimate (``memory.py``) against what each rank has: a GPU's memory
with the allowance for what is not tensors (``gpu_allowance.py``), or a share of host RAM; before
launch (``check_fits``, the dry run's table) and on a started rank (``startup_memory_problem``)."""

from __future__ import annotations

import os

from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate.gpu_allowance import AllowanceFigures, rank_allowances
from disttrain_ds.estimate.memory import (
    CPU_PROCESS_GIB,
    GIB,
    StageMemory,
    _size,
    per_rank_totals,
    state_bytes,
    zero_stage,
)


def limit_is_gpu(recipe) -> bool:
    """Whether ``device_limit_gib`` gives a GPU's memory (so the allowance of ``gpu_allowance.py``
    applies), not a share of host RAM."""
    if recipe.train.device_memory_gib > 0:
        return True
    import torch

    return torch.cuda.is_available()


def device_limit_gib(recipe, ranks_per_host: int) -> tuple[float, str]:
    """Memory each rank may use, in GiB, and where the figure comes from."""
    if recipe.train.device_memory_gib > 0:
        return recipe.train.device_memory_gib, "train.device_memory_gib"
    import torch

    if limit_is_gpu(recipe):
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        return total, f"{torch.cuda.get_device_name(0)} memory"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    share = ram / max(ranks_per_host, 1) - CPU_PROCESS_GIB
    return share, f"host RAM {ram:.1f} GiB / {ranks_per_host} ranks - {CPU_PROCESS_GIB:g} GiB runtime each"


def _needs(recipe, rows: list[StageMemory], gpu: bool) -> tuple[dict[int, float], dict, dict[int, float]]:
    """(estimates, allowances, estimate + allowance) of every rank; allowances only against a GPU's
    memory (``gpu``) with ``train.gpu_allowance`` on (``gpu_allowance.py``)."""
    totals = per_rank_totals(rows)
    extra = rank_allowances(recipe, totals) if gpu else {}
    return totals, extra, {r: t + (extra[r].total if r in extra else 0.0) for r, t in totals.items()}


def per_rank_needs(recipe, rows: list[StageMemory], gpu: bool = True) -> dict[int, float]:
    """What the memory check holds each rank to: its estimated peak plus, on a GPU, its allowance."""
    return _needs(recipe, rows, gpu)[2]


def check_fits(recipe, rows: list[StageMemory], limit_gib: float, source: str, gpu: bool = True) -> None:
    """Raise a one-line ``ConfigError`` naming the rank and module whose estimate (plus, against a
    GPU's memory, its allowance: ``gpu_allowance.py``) exceeds the limit."""
    totals, extra, needs = _needs(recipe, rows, gpu)
    worst = max(needs, key=needs.get)
    if needs[worst] <= limit_gib * GIB:
        return
    here = [r for r in rows if worst in r.ranks]
    big = max(here, key=lambda r: r.total)
    who = big.who() if len(here) == 1 else f"rank {worst} ({big.module} {_size(big.total)} of it, with " \
        f"{' and '.join(r.module for r in here if r is not big)} in the same process)"
    parts = ", ".join(f"{k} {_size(sum(getattr(r, k) for r in here))}"
                      for k in ("weights", "grads", "optimizer", "activations", "bucket", "extra")
                      if k in ("weights", "grads", "optimizer", "activations") or any(getattr(r, k) for r in here))
    over = f" + {extra[worst].describe()}" if worst in extra else ""
    raise ConfigError(
        f"{recipe.source_file}: {who} does not fit: estimate {_size(totals[worst])} ({parts}){over} > "
        f"{_size(limit_gib * GIB)} ({source}); more ranks (parallel.*) or a smaller train.micro_batch or "
        "data.seq_len lower it (--dry-run shows every rank)"
    )


def describe(recipe, rows: list[StageMemory], limit_gib: float, source: str, gpu: bool = True) -> list[str]:
    """The dry run's table: one line per stage (the ranks holding it), then the largest rank with
    its allowance (``gpu``: the limit is a GPU's memory)."""
    per = state_bytes(recipe, "llm")
    zero = "reference: torch optimizer" if recipe.layout == "reference" else f"ZeRO stage {zero_stage(recipe, 'llm')}"
    lines = [f"memory per rank, estimated ({recipe.train.dtype}, {recipe.optim.name}, {zero}; "
             f"llm bytes/param weights {per[0]:g} grads {per[1]:g} optimizer {per[2]:g}"
             f"{' / dp' if per[3] else ''}), limit {_size(limit_gib * GIB)} ({source}):",
             f"  {'ranks':<11} {'module':<9} {'stage':>5} {'layers':>7} {'params':>9} {'weights':>8} "
             f"{'grads':>8} {'optim':>8} {'activ':>8} {'in flight':>10} {'total':>8} {'use':>5}"]
    for r in rows:
        ranks = f"{r.ranks.start}" if len(r.ranks) == 1 else f"{r.ranks.start}-{r.ranks.stop - 1}"
        flight = f"{r.in_flight} x {r.samples}"
        lines.append(
            f"  {ranks:<11} {r.module:<9} {r.stage:>5} {r.layers.start:>3}-{r.layers.stop - 1:<3} "
            f"{r.params / 1e6:>8.2f}M {_size(r.weights, True):>8} {_size(r.grads, True):>8} "
            f"{_size(r.optimizer, True):>8} {_size(r.activations, True):>8} {flight:>10} "
            f"{_size(r.total, True):>8} {f'{100 * r.total / GIB / limit_gib:.0f}%' if limit_gib > 0 else '-':>5}"
        )
    lines += [f"  {r.who()} also holds the frozen VAE (placement generator): {_size(r.extra)}, in its total"
              for r in rows if r.extra]
    totals, extra, needs = _needs(recipe, rows, gpu)
    worst = max(needs, key=needs.get)
    beside = f" + {extra[worst].describe()}" if worst in extra else " (no allowance beside the tensors)"
    lines.append(f"largest: rank {worst}, estimate {_size(totals[worst])}{beside} of {_size(limit_gib * GIB)} "
                 f"(activations: the largest sample the data allows)")
    return lines


def startup_memory_problem(recipe, rows: list, rank: int, free_bytes: int, total_bytes: int,
                           figures: AllowanceFigures | None = None) -> str | None:
    """Whether ``rank``'s estimate fits what its GPU has free once its process groups exist: one
    line naming the rank when it does not, else None. ``rows``: ``memory.estimate(recipe)``;
    ``free_bytes, total_bytes``: ``torch.cuda.mem_get_info()`` on the rank. What the device
    already holds (the CUDA context, other processes) is outside ``free_bytes``, so the part of the
    allowance still to come is the workspaces, NCCL's buffers and fragmentation. NCCL allocates a
    connection's buffers when it first connects that peer, in recent releases at the first
    operation that needs it: some may already be in use, and counting them all errs on the safe side."""
    figures = figures or AllowanceFigures.from_env(os.environ)
    estimate = per_rank_totals(rows)[rank]
    here = [r for r in rows if rank in r.ranks]
    who = f"rank {rank} ({', '.join(f'{r.module} stage {r.stage}' for r in here)})"
    full = rank_allowances(recipe, {rank: estimate}, figures).get(rank)
    to_come, what = 0.0, ""
    if full is not None:  # the context is already outside free_bytes; the workspaces are not
        to_come = figures.workspaces + full.nccl + full.fragmentation
        what = (f" + allowance still to come {_size(to_come)} (workspaces {_size(figures.workspaces)}, "
                f"NCCL {_size(full.nccl)}, fragmentation {_size(full.fragmentation)})")
    if estimate + to_come <= free_bytes:
        return None
    return (f"{recipe.source_file}: {who} does not fit its GPU: estimate {_size(estimate)}{what} > "
            f"{_size(free_bytes)} free of {_size(total_bytes)} ({_size(total_bytes - free_bytes)} already in use: "
            "CUDA context, other processes); free the GPU, or lower the estimate with more ranks (parallel.*), a "
            "smaller train.micro_batch or data.seq_len (--dry-run shows every rank)")

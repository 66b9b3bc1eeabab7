"""Does a recipe fit the slots a launch picks: rank count, per-rank memory, TP groups per host.

Checked on the launching machine before any process starts, so a mismatch is one line naming
the hostfile and the recipe instead of a failure once every rank has started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain_ds.errors import plural
from disttrain_ds.launcher.hostfile import Host, LaunchError, slots_summary
from disttrain_ds.recipe.graph import topology_of

if TYPE_CHECKING:  # annotations only; loading a recipe is not this module's business
    from disttrain_ds.recipe.schema import Recipe


def required_ranks(recipe: Recipe) -> tuple[int, str]:
    """Ranks a recipe's layout needs, and the per-module breakdown that explains the number."""
    if recipe.layout == "reference":
        return 1, "reference: one process"

    topo = topology_of(recipe)
    return topo.world_size, " + ".join(f"{m.name} {m.size}" for m in topo.modules)


def check_memory(recipe: Recipe) -> str:
    """Check each rank's estimated peak plus its allowance (CUDA context, NCCL buffers,
    fragmentation: ``estimate/gpu_allowance.py``) against ``train.device_memory_gib`` (a one-line
    ``ConfigError`` naming the rank when one does not fit); the line reporting it. Without that
    field the launching machine says nothing about the nodes: each rank checks at start-up."""
    if recipe.train.device_memory_gib <= 0:
        return "memory: checked by every rank at start-up (set train.device_memory_gib to check here)"
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.gpu_allowance import rank_allowances
    from disttrain_ds.estimate.memory import GIB, estimate, per_rank_totals
    from disttrain_ds.estimate.memory_check import check_fits, per_rank_needs

    rows = estimate(recipe, cuda=True)  # the nodes' GPUs, whatever the launching machine has
    check_fits(recipe, rows, recipe.train.device_memory_gib, "train.device_memory_gib")
    totals, needs = per_rank_totals(rows), per_rank_needs(recipe, rows)
    worst = max(needs, key=needs.get)
    extra = rank_allowances(recipe, {worst: totals[worst]}).get(worst)
    beside = f" + {extra.describe()}" if extra is not None else ""
    return (f"memory: estimated peak {totals[worst] / GIB:.1f} GiB{beside} (rank {worst}) of "
            f"{recipe.train.device_memory_gib:g} GiB per device: fits")


def tp_span_problems(recipe: Recipe, active: dict[str, list[int]], axis: str = "tp") -> list[str]:
    """TP groups (``axis="sp"``: sequence-parallel groups) whose ranks the launcher puts on more
    than one host (ranks go host by host in hostfile order, as DeepSpeed's runner assigns them):
    "module ranks a-b (host x, host y)"."""
    if recipe.layout == "reference":
        return []

    host_of = [name for name, slots in active.items() for _ in slots]
    out = []
    for m in topology_of(recipe).modules:
        degree, groups = (m.tp, m.tp_groups) if axis == "tp" else (m.sp, m.sp_groups)
        for group in groups() if degree > 1 else ():
            hosts = list(dict.fromkeys(host_of[r] for r in group if r < len(host_of)))
            if len(hosts) > 1:
                out.append(f"{m.name} ranks {group[0]}-{group[-1]} ({', '.join(hosts)})")
    return out


def check_slots(
    hosts: list[Host],
    active: dict[str, list[int]],
    *,
    src: str,
    ranks: int,
    breakdown: str,
    layout: str,
    recipe_src: str,
    filtered: bool,
) -> None:
    """Raise unless the slots used equal the ranks the layout needs; the message suggests a fix."""
    used = sum(len(slots) for slots in active.values())
    if used == ranks:
        return
    if len(hosts) == 1 and not filtered:
        fix = f"set '{hosts[0].name} slots={ranks}' on {src}:{hosts[0].line}"
    elif filtered:
        fix = f"change --num_nodes/--num_gpus/--include/--exclude or {src} so that {ranks} slots are used"
    else:
        fix = f"make the slots in {src} add up to {ranks} (or pick them with --num_nodes/--num_gpus/--include)"
    other = "choose a distributed layout" if layout == "reference" else "change the recipe's parallel.* degrees"
    raise LaunchError(
        f"{src}: {plural(used, 'slot')} used ({slots_summary(active)}) but layout '{layout}' of {recipe_src} needs "
        f"{plural(ranks, 'rank')} ({breakdown}); {fix}, or {other}"
    )

"""Every process group of a job, made by every rank in one global order.

NCCL starts one of two ways. Under torchrun without a device binding it makes communicators lazily,
on first use, so a group can be made by its members alone. Once the world is bound to a device
(``init_process_group(device_id=...)``: the ``deepspeed`` launcher does it, and this project's
start-up does it on every launcher), torch makes every later group by ``ncclCommSplit`` of the
world communicator: a collective of *all* world ranks, in the same order. One rule holds under
both: every rank makes every group of the job, in the order ``plan_groups`` lists them, with the
job's deadline; each rank keeps the handles of the groups it belongs to. On a device-bound world a
group made by its members only (``use_local_synchronization=True``) would deadlock start-up, so
``refuse_member_only_groups`` turns it into one line naming the group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as tdist

from disttrain_ds.comm.p2p import CHANNELS, channel
from disttrain_ds.parallel.grid import GRID_AXES, SEQ, grid_groups
from disttrain_ds.topology import ModuleGrid

META = "meta"
"""Key of the job-wide gloo group for step figures and bookkeeping (small CPU tensors)."""


class StartupError(RuntimeError):
    """A process group about to be made in a way that deadlocks start-up on NCCL."""


@dataclass(frozen=True)
class GroupSpec:
    """One process group of the job."""

    key: tuple
    """``("meta",)``, ``("channel", name)``, ``(module, axis, index)`` or ``(module, "tied", index)``:
    how the runtime asks for it."""
    ranks: tuple[int, ...]
    """Its global ranks, sorted."""
    backend: str | None = None
    """None: the job's backend (NCCL on GPUs); ``"gloo"`` for CPU bookkeeping."""


TIED = "tied"
"""Axis name of a module's tied-weight groups."""


def tied_pairs(m: ModuleGrid) -> list[tuple[int, int]]:
    """(first-stage rank, last-stage rank) of every (DP, SP, TP) coordinate of ``m``: the ranks whose copies
    of a tied weight (the input embedding on the first stage, the LM head on the last) sum their
    gradients. Empty on a single stage, where the tie is one parameter."""
    if m.pp == 1:
        return []
    return [(m.rank(stage=0, dp=d, tp=t, sp=q), m.rank(stage=m.pp - 1, dp=d, tp=t, sp=q))
            for d in range(m.dp) for q in range(m.sp) for t in range(m.tp)]


def plan_groups(modules: tuple[ModuleGrid, ...], world: int, tied: frozenset[str] = frozenset(),
                edges: tuple[tuple[str, str], ...] | None = None) -> list[GroupSpec]:
    """Every group of the job in the one order all ranks make them: the gloo bookkeeping group, one
    group per boundary channel (each graph edge's activations and gradients, ``p2p.channel``: the
    upstream module's last-stage ranks and the downstream's first-stage ones; ``edges`` None: a
    chain in ``modules`` order), then each module's DeepSpeed grid groups (replica, data, pipe, model
    axes, as ``SubsetGrid`` uses them), its sequence-parallel groups (where SP > 1; with ``sp: auto``
    every aligned group a microbatch may form) and, for the modules named in ``tied`` (a weight shared
    by their first and last layers), their tied-weight groups. Pure: every rank computes the same list."""
    everyone = tuple(range(world))
    specs = [GroupSpec((META,), everyone, "gloo")]
    grids = {m.name: m for m in modules}
    for up, down in edges if edges is not None else [(a.name, b.name) for a, b in zip(modules, modules[1:])]:
        u, d = grids[up], grids[down]
        # SP index 0 of a stage talks across a boundary for its group.
        ends = tuple(sorted({*(r for r in u.ranks if u.coords(r)[0] == u.pp - 1 and u.sp_index(r) == 0),
                             *(r for r in d.ranks if d.coords(r)[0] == 0 and d.sp_index(r) == 0)}))
        specs += [GroupSpec(("channel", channel(kind, up, down)), ends) for kind in CHANNELS]
    for m in modules:
        lists = grid_groups(m)
        for axis in GRID_AXES:
            specs += [GroupSpec((m.name, axis, i), tuple(sorted(r))) for i, r in enumerate(lists[axis])]
        if m.sp > 1:
            specs += [GroupSpec((m.name, SEQ, i), tuple(r)) for i, r in enumerate(m.sp_groups())]
        # Adaptive SP: every group a microbatch may form, made once (keyed by (first, size, ranks)).
        specs += [GroupSpec((m.name, SEQ, (first, size, tuple(r))), tuple(r))
                  for (first, size), r in m.adaptive_groups()]
        if m.name in tied:
            specs += [GroupSpec((m.name, TIED, i), pair) for i, pair in enumerate(tied_pairs(m))]
    return specs


class ProcessGroups:
    """The groups this rank belongs to, made by ``make`` (every rank, same plan, same order)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.handles: dict[tuple, object] = {}
        self.ranks: dict[tuple, tuple[int, ...]] = {}
        self.made = 0
        """Groups made (all of the plan, including those this rank is not in)."""

    def make(self, specs: list[GroupSpec], timeout_s: float, new_group: Callable | None = None) -> "ProcessGroups":
        """Make every group of ``specs`` in order, each with the job's deadline (NCCL's own default
        is 10 minutes, whatever ``parallel.comm_timeout_s`` says)."""
        new_group = new_group or tdist.new_group
        timeout = timedelta(seconds=timeout_s)
        for spec in specs:
            handle = new_group(list(spec.ranks), timeout=timeout, backend=spec.backend)
            self.made += 1
            if self.rank in spec.ranks:
                self.handles[spec.key], self.ranks[spec.key] = handle, spec.ranks
        return self

    def get(self, key: tuple):
        return self.handles[key]

    def module_axes(self, module: str) -> dict[str, tuple[list[int], object]]:
        """This rank's group on each grid axis of ``module``: axis -> (ranks, handle)."""
        out = {}
        for key, handle in self.handles.items():
            if len(key) == 3 and key[0] == module and key[1] in GRID_AXES:
                out[key[1]] = (list(self.ranks[key]), handle)
        missing = [a for a in GRID_AXES if a not in out]
        if missing:
            raise KeyError(f"rank {self.rank} has no {module} group on axes {missing}")
        return out


    def seq_group(self, module: str) -> tuple[list[int], object] | None:
        """This rank's sequence-parallel group of ``module``: (ranks, handle), or None without SP."""
        found = [(list(self.ranks[k]), h) for k, h in self.handles.items()
                 if len(k) == 3 and k[0] == module and k[1] == SEQ and isinstance(k[2], int)]
        return found[0] if found else None

    def adaptive_groups(self, module: str) -> dict[tuple[int, int], tuple[list[int], object]]:
        """With adaptive SP: each group of ``module`` this rank is in, by (first data index, size)."""
        return {k[2][:2]: (list(self.ranks[k]), h) for k, h in self.handles.items()
                if len(k) == 3 and k[0] == module and k[1] == SEQ and isinstance(k[2], tuple)}

    def tied_group(self, module: str):
        """This rank's tied-weight group of ``module`` (None: it holds no copy of a tied weight that
        another stage also holds)."""
        found = [h for k, h in self.handles.items() if len(k) == 3 and k[0] == module and k[1] == TIED]
        return found[0] if found else None


def device_bound() -> bool:
    """Whether the default group is bound to a device (eager NCCL: every group is a world-wide split)."""
    try:
        return tdist.distributed_c10d._get_default_group().bound_device_id is not None
    except (RuntimeError, ValueError, AttributeError):
        return False


def refuse_member_only_groups() -> None:
    """From now on, a group made with ``use_local_synchronization=True`` stops this rank with one
    line instead of deadlocking start-up (call on a device-bound world, or under the eager
    emulation; idempotent)."""
    made = tdist.new_group
    if getattr(made, "_refuses_member_only", False):
        return

    @functools.wraps(made)
    def new_group(ranks=None, *args, use_local_synchronization: bool = False, **kwargs):
        if use_local_synchronization:
            shown = sorted(ranks)[:8] if ranks is not None else "all"
            raise StartupError(
                f"process group of ranks {shown} made by its members only (use_local_synchronization=True) "
                "on a device-bound world: NCCL splits every group off the world communicator, so every "
                "rank must make it, in one order, or start-up deadlocks")
        return made(ranks, *args, use_local_synchronization=use_local_synchronization, **kwargs)

    new_group._refuses_member_only = True
    tdist.new_group = new_group

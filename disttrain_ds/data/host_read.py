"""Which samples of a global batch each host reads (``data.read: host``), as pure functions.

A rank of module ``m`` with DP index ``d`` consumes, in every microbatch slot ``g``, the block
``blocks(slot, dp_m)[d]`` (``comm/routes.py``). A host reads the positions its ranks consume and
no others. A source reads a batch in *units* (a sample for ``synthetic``; a part for a sharded
data set with ``data.shard_parts``), each a set of positions; a unit whose positions are
consumed by different sets of hosts would make some host read samples it does not use, so it is
refused. Every position has one *contributor*, the lowest rank reading it, that counts it once in
the batch-wide figures all ranks add up (loss normalisation, metrics).

Parts fill whole *columns*: each slot is cut into ``columns`` equal blocks (the lcm of the
modules' DP degrees, so every DP block is whole columns); part-concatenation order runs column by
column, through every slot, so one part is the same block of every microbatch
(``column_positions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EMULATED_HOSTS_ENV = "DISTTRAIN_EMULATED_HOSTS"
"""Comma-separated host name of each rank (rank order): emulates several hosts on one machine
(tests, trying a layout); unset: every rank's host is its machine."""


def slot_columns(dps: list[int]) -> int:
    """Equal blocks a slot is cut into so every module's DP block is whole blocks."""
    return math.lcm(*dps) if dps else 1


def column_positions(batch: int, slot: int, columns: int) -> list[int]:
    """Global position of each index of the part-concatenated batch: column-major, then slot."""
    if slot < 1 or batch % slot or slot % columns:
        raise ValueError(f"a global batch of {batch} in slots of {slot} does not split into {columns} columns")
    width = slot // columns
    return [g * slot + k * width + i for k in range(columns) for g in range(batch // slot) for i in range(width)]


def rank_positions(modules, slot: int, batch: int) -> dict[int, set[int]]:
    """Positions each rank consumes: its module's DP block of every slot (``modules``: the
    topology's ``ModuleGrid``s)."""
    out: dict[int, set[int]] = {}
    for m in modules:
        width = slot // m.dp
        for r in m.ranks:
            d = m.coords(r)[1]
            out.setdefault(r, set()).update(g + d * width + i for g in range(0, batch, slot) for i in range(width))
    return out


def replica_hosts(modules, hosts: list[str]) -> dict[str, list[frozenset[str]]]:
    """Per module (the topology's ``ModuleGrid``s), the hosts each DP replica's ranks run on: a
    replica reads (and may compute units of) only the samples all of them read."""
    return {m.name: [frozenset(hosts[r] for r in m.ranks if m.coords(r)[1] == d) for d in range(m.dp)]
            for m in modules}


@dataclass(frozen=True)
class HostReading:
    """What every host reads, and who counts each position once."""

    units: dict[str, tuple[int, ...]]
    """Host name -> indices of the units it reads, ascending."""
    contributor: tuple[int, ...]
    """Per global position, the rank that counts it in batch-wide sums."""

    def positions_of(self, rank: int) -> list[int]:
        """Positions ``rank`` contributes to batch-wide sums."""
        return [p for p, r in enumerate(self.contributor) if r == rank]


def position_readers(hosts: list[str], consumed: dict[int, set[int]], batch: int) -> list[frozenset[str]]:
    """The hosts whose ranks consume each position (``hosts[rank]``)."""
    readers: list[set[str]] = [set() for _ in range(batch)]
    for rank, positions in consumed.items():
        for p in positions:
            readers[p].add(hosts[rank])
    return [frozenset(r) for r in readers]


def reader_classes(hosts: list[str], consumed: dict[int, set[int]], batch: int) -> list[int]:
    """Per position, a label shared by exactly the positions read by the same hosts: reordering
    that keeps every sample on a position of its label moves no sample across hosts."""
    readers = position_readers(hosts, consumed, batch)
    names = sorted(set(readers), key=sorted)
    return [names.index(r) for r in readers]


def plan_reading(units: list[list[int]], hosts: list[str], consumed: dict[int, set[int]], batch: int) -> HostReading:
    """Each host's units from the ranks' hosts (``hosts[rank]``) and positions; ``ValueError``
    naming the first unit whose positions belong to different hosts."""
    readers = position_readers(hosts, consumed, batch)
    if any(not r for r in readers):
        raise ValueError(f"positions {[p for p, r in enumerate(readers) if not r][:4]} are consumed by no rank")
    out: dict[str, list[int]] = {h: [] for h in hosts}
    for j, unit in enumerate(units):
        sets = {frozenset(readers[p]) for p in unit}
        if len(sets) > 1:
            a, b = sorted(sorted(s) for s in sets)[:2]
            raise ValueError(f"unit {j} holds samples of hosts {a} and of hosts {b}")
        for h in next(iter(sets)):
            out[h].append(j)
    first = {h: min(r for r, x in enumerate(hosts) if x == h) for h in set(hosts)}
    contributor = [0] * batch
    for p in range(batch):
        contributor[p] = min(first[h] for h in readers[p])
    return HostReading({h: tuple(u) for h, u in out.items()}, tuple(contributor))


def host_names(keys: list[str], emulated: str | None) -> list[str]:
    """Each rank's host: its machine's key, or the emulated names (one per rank)."""
    if not emulated:
        return keys
    names = [n.strip() for n in emulated.split(",")]
    if len(names) != len(keys) or not all(names):
        raise ValueError(f"{EMULATED_HOSTS_ENV}: names {len(names)} hosts for {len(keys)} ranks (one non-empty name per rank)")
    return [f"{k}#{n}" for k, n in zip(keys, names)]


def merge_states(states: list[dict]) -> dict:
    """One data state from every host's: a part's state comes from a host that read it (the one
    furthest on; hosts that never read a part hold its initial state)."""
    base = dict(states[0])
    inners = [s.get("inner") or {} for s in states]
    if inners[0].get("kind") != "parts":
        return base
    parts = []
    for j in range(len(inners[0]["parts"])):
        parts.append(max((i["parts"][j] for i in inners), key=lambda p: int(p.get("next_step", 0))))
    base["inner"] = {**inners[0], "parts": parts}
    return base


def aligned_parts(batch: int, slot: int, columns: int, hosts: list[str], consumed: dict[int, set[int]]) -> int | None:
    """The fewest ``data.shard_parts`` whose parts each fall on whole hosts, or None."""
    order = column_positions(batch, slot, columns)
    for parts in (p for p in range(1, batch + 1) if batch % p == 0):
        n = batch // parts
        try:
            plan_reading([order[j * n:(j + 1) * n] for j in range(parts)], hosts, consumed, batch)
        except ValueError:
            continue
        return parts
    return None

"""Which samples, and which of their units of work, every module's replicas hold in each microbatch slot.

A module's units are what it computes one by one: an encoder's items (images, audio clips), a
generator's target images; the LLM's are whole samples. By default every module splits each slot
into contiguous, equal blocks of samples over its DP replicas, and an encoder or generator replica
computes the units of its block's samples. With ``parallel.post_balance``
(``reorder/post_balance.py``) every encoder and generator assigns the slot's units themselves to its
replicas by its own per-unit costs, so one sequence's images may be encoded, and its targets
generated, on several replicas; the LLM keeps its blocks. Every rank makes the same placement: the
costs and the assignment are deterministic functions of the step's samples, which every rank reads
whole.

With adaptive sequence parallelism (``parallel.<module>.sp: auto``) a module's replicas form SP
groups per slot by the lengths of what they run: the LLM's by its samples' tokens
(``reorder/sp_groups.py::covering_groups``, every replica holding at least one), an encoder's by
its items' rows (``adaptive_groups``; ranks it leaves idle hold nothing). Every rank of a group
holds the group's samples or items, and its first rank (the lead) is the replica that boundaries
route them to.

A boundary carries units (one row count per unit, in slot order, so the LLM's rows keep its
samples' order; ``SlotPlan.edge_owners``). A message carries the units both of its ends hold, in
slot order, so a rank needs to know only the samples it holds (what a host reads with
``data.read: host``).

With ``data.read: host`` a host reads only the samples of its ranks' contiguous blocks, so a
post-balanced module splits into groups of replicas on the same hosts (``homes``): each group
assigns the units of its own blocks' samples among its replicas. The costs of the samples a host
did not read come from their outlines (``data/outline.py``), which every rank gets each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from disttrain_ds.comm.routes import blocks
from disttrain_ds.cost.graph_costs import unit_costs
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.reorder.post_balance import assign, owners_of, share_cap
from disttrain_ds.reorder.sp_groups import SPPlan, adaptive_groups, covering_groups
from disttrain_ds.runtime.setup import cost_model, sp_cost
from disttrain_ds.samples import PackedSample

Unit = tuple[int, int]
"""(slot position of the sample, index of the unit among the sample's units of the module: its
items of the encoder's modality, or its targets of the generator)."""


@dataclass(frozen=True)
class SlotPlan:
    """Who holds what of one microbatch slot."""

    samples: dict[str, list[list[int]]]
    """The LLM: each replica's sample positions (ascending)."""
    units: dict[str, list[list[Unit]]]
    """Every encoder and generator: each replica's units (ascending)."""
    llm: str
    """The LLM's name (the other end of every boundary)."""
    groups: dict[str, list[tuple[int, int, tuple]]] = field(default_factory=dict)
    """Adaptive SP modules: each group's (first replica, size, what it holds: the LLM's sample
    positions, an encoder's units); ``samples`` or ``units`` then list them under the group's
    first replica only."""

    def edge_owners(self, up: str, down: str) -> tuple[list[int], list[int]]:
        """The (upstream, downstream) replica of each unit the boundary ``up`` -> ``down`` carries,
        in slot order: the units of its module that is not the LLM."""
        if up not in self.units and down not in self.units:
            return owners_of(self.samples[up]), owners_of(self.samples[down])
        module = up if up in self.units else down
        units = sorted(u for part in self.units[module] for u in part)
        at = {u: r for r, part in enumerate(self.units[module]) for u in part}
        llm = owners_of(self.samples[self.llm])
        mine, theirs = [at[u] for u in units], [llm[u[0]] for u in units]
        return (mine, theirs) if module == up else (theirs, mine)


def carriers(samples: list, base: int, units: list[Unit], slot: int, spec, module: str) -> list[PackedSample]:
    """A replica's microbatch of encoder or generator ``module``: per sample it holds units of,
    that sample with only those units (and no other module's items or targets); a replica holding
    nothing gets one sample of the slot (one its host read) with none, so it runs on zero rows (a
    generator: on its zero-weight stand-in)."""
    by_pos: dict[int, list[int]] = {}
    for pos, j in units:
        by_pos.setdefault(pos, []).append(j)
    if not by_pos:
        held = next(s for s in samples[base:base + slot] if s is not None)
        return [replace(held, images=[], audio=[], gen_targets=[])]
    keep = _keep_targets if spec.roles[module] == "generator" else _keep_items
    return [keep(samples[base + pos], js, spec, module) for pos, js in sorted(by_pos.items())]


def _keep_items(s: PackedSample, js: list[int], spec, module: str) -> PackedSample:
    modality = spec.modality(module)
    field = "images" if modality == "image" else "audio"
    other = "audio" if modality == "image" else "images"
    return replace(s, **{field: [s.inputs(modality)[j] for j in js], other: []}, gen_targets=[])


def _keep_targets(s: PackedSample, js: list[int], spec, module: str) -> PackedSample:
    k = spec.gen_index(module)
    ids = list(s.target_ids(k))
    gen = [t[:0] for t in s.gen_targets]
    gen[k] = s.gen_targets[k][js]
    index = [()] * len(gen)
    index[k] = tuple(ids[j] for j in js)
    return replace(s, images=[], audio=[], gen_targets=gen, target_index=tuple(index))


class Placement:
    """Each module's replicas' samples and units, microbatch slot by slot, for one recipe."""

    def __init__(self, recipe: Recipe, spec, dps: dict[str, int], homes: dict[str, list[frozenset[str]]] | None = None,
                 adaptive: list[str] | tuple[str, ...] = (), per_node: int = 1):
        """``homes``: with ``data.read: host``, the hosts of each module's replicas
        (``data.host_read.replica_hosts``); None: every host reads whole batches. ``adaptive``: the
        modules with ``sp: auto``; ``per_node``: ranks per host (an SP group of more ranks is priced
        at the bandwidth across nodes)."""
        self.spec, self.dps, self.slot = spec, dps, recipe.parallel.llm.dp * recipe.train.micro_batch
        self.balanced = recipe.parallel.post_balance
        self.share = recipe.parallel.post_balance_share
        self.costs = cost_model(recipe)
        self.llm = spec.name_of("llm")
        self.homes = homes
        self.sp_costs = {m: sp_cost(recipe, spec, m, per_node) for m in adaptive}
        self._last: tuple[list, list[SlotPlan]] | None = None  # (a batch, its plans)

    def plans(self, samples: list) -> list[SlotPlan]:
        """Per microbatch slot of the global batch ``samples``, who holds what (the last batch's
        kept: the step and its balance figures ask for the same one)."""
        if self._last is None or self._last[0] is not samples:
            self._last = (samples, [self._plan(samples[g * self.slot:(g + 1) * self.slot])
                                    for g in range(len(samples) // self.slot)])
        return self._last[1]

    def _plan(self, slot: list) -> SlotPlan:
        samples, units, groups = {}, {}, {}
        for m, dp in self.dps.items():
            if m in self.sp_costs and m != self.llm:
                groups[m], units[m] = self._item_groups(slot, m, dp)
                continue
            if m in self.sp_costs:
                plan = covering_groups([int(s.input_ids.shape[0]) for s in slot], dp, self.sp_costs[m])
                if plan is None:
                    raise RuntimeError(f"{m}: no SP groups of {dp} ranks hold this microbatch's sequences")
                groups[m] = [(g.first, g.size, g.seqs) for g in plan.groups]
                samples[m] = [[] for _ in range(dp)]
                for g in plan.groups:
                    samples[m][g.first] = list(g.seqs)
                continue
            if m == self.llm:
                samples[m] = [list(b) for b in blocks(self.slot, dp)]
                continue
            mine = self._units(slot, m)
            own = blocks(self.slot, dp)
            if not (self.balanced and dp > 1):
                units[m] = [[u for u in mine if u[0] in b] for b in own]
                continue
            units[m] = [[] for _ in range(dp)]
            for group in self._groups(m, dp):  # replicas on the same hosts share their blocks' units
                held = {p for r in group for p in own[r]}
                part = [u for u in mine if u[0] in held]
                cap = share_cap(len(part), len(group), self.share)
                # A unit stays on its block's replica unless balance needs it elsewhere.
                home = [next(i for i, r in enumerate(group) if u[0] in own[r]) for u in part]
                if max(np.bincount(home, minlength=len(group))) > cap:
                    home = None
                for r, g in zip(group, assign(self._unit_costs(slot, m, part), len(group), 0, cap, home=home)):
                    units[m][r] = [part[i] for i in g]
        return SlotPlan(samples, units, self.llm, groups)

    def _item_groups(self, slot: list, module: str, dp: int) -> tuple[list[tuple[int, int, tuple]], list[list[Unit]]]:
        """Encoder ``module`` under adaptive SP: its SP groups of the slot's items, by their rows,
        and each replica's units (a group's under its lead)."""
        mine = self._units(slot, module)
        per = {p: self.spec.rows_of_items(module, slot[p]) for p in {p for p, _ in mine}}
        rows = [per[p][j] for p, j in mine]
        plan = adaptive_groups(rows, dp, self.sp_costs[module]) if mine else SPPlan(())
        if plan is None:
            raise RuntimeError(f"{module}: no SP groups of {dp} ranks hold this microbatch's items in memory")
        held = {g.first: g for g in plan.groups}
        groups, units, r = [], [[] for _ in range(dp)], 0
        while r < dp:  # ranks no group covers hold nothing, each on its own
            g = held.get(r)
            size, part = (g.size, tuple(mine[i] for i in g.seqs)) if g is not None else (1, ())
            groups.append((r, size, part))
            units[r] = list(part)
            r += size
        return groups, units

    def _groups(self, module: str, dp: int) -> list[list[int]]:
        """``module``'s replicas grouped by the hosts they run on (one group: every host reads all)."""
        if self.homes is None:
            return [list(range(dp))]
        out: dict[frozenset[str], list[int]] = {}
        for r, hosts in enumerate(self.homes[module]):
            out.setdefault(hosts, []).append(r)
        return list(out.values())

    def _units(self, slot: list, module: str) -> list[Unit]:
        """The slot's units of ``module`` (with ``data.read: host``, no post-balancing: those of the
        samples this host read, which the two ends of a boundary share and order the same way)."""
        count = self._counter(module)
        return [(p, j) for p, s in enumerate(slot) if s is not None for j in range(count(s))]

    def _counter(self, module: str):
        if self.spec.roles[module] == "generator":
            k = self.spec.gen_index(module)
            return lambda s: 0 if s.targets(k) is None else int(s.targets(k).shape[0])
        modality = self.spec.modality(module)
        return lambda s: len(s.inputs(modality))

    def _unit_costs(self, slot: list, module: str, units: list[Unit]) -> list[float]:
        """Each unit's forward cost in ``module``."""
        per: dict[int, list[float]] = {}
        for p, _ in units:
            if p not in per:
                per[p] = unit_costs(self.spec, self.costs, module, slot[p])
        return [per[p][j] for p, j in units]

    def group_figures(self, samples: list) -> dict[str, float]:
        """Adaptive SP modules: ``sp/<module>_groups_<size>``, how many groups of each size the
        step's slots formed, and ``sp/<module>_ranks_split``, the share of their ranks in groups of 2 or more."""
        out: dict[str, float] = {}
        for m in self.sp_costs:
            sizes = [size for plan in self.plans(samples) for _, size, _ in plan.groups[m]]
            for size in sorted(set(sizes)):
                out[f"sp/{m}_groups_{size}"] = float(sizes.count(size))
            out[f"sp/{m}_ranks_split"] = sum(s for s in sizes if s > 1) / max(sum(sizes), 1)
        return out

    def loads(self, samples: list) -> dict[str, list[np.ndarray]]:
        """Every module but the LLM: its replicas' summed forward costs in each slot (what
        ``balance/<module>_load_*`` report)."""
        out: dict[str, list[np.ndarray]] = {m: [] for m in self.dps if m != self.llm}
        for g, plan in enumerate(self.plans(samples)):
            slot = samples[g * self.slot:(g + 1) * self.slot]
            for m in out:
                out[m].append(np.array([sum(self._unit_costs(slot, m, part)) for part in plan.units[m]]))
        return out

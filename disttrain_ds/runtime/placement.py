"""Which samples, and which of their items, every module's replicas hold in each microbatch slot.

By default every module splits each slot into contiguous, equal blocks over its DP replicas, and an
encoder replica encodes the items (images, audio clips) of its block's samples. With
``parallel.post_balance`` (``reorder/post_balance.py``) every encoder assigns the slot's items
themselves to its replicas by its own per-item costs, so one sequence's images may be encoded on
several replicas, and every generator assigns the slot's samples (with their targets); the LLM
keeps its blocks. Every rank makes the same placement: the costs and the assignment are
deterministic functions of the step's samples, which every rank reads whole.

A boundary carries units: an encoder's edge its items (rows per item, in slot order, so the LLM's
rows keep its samples' order), a generator's edge whole samples (``SlotPlan.edge_owners``). A
message carries the units both of its ends hold, in slot order, so a rank needs to know only the
samples it holds (what a host reads with ``data.read: host``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from disttrain_ds.comm.routes import blocks
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.reorder.post_balance import assign, owners_of, share_cap
from disttrain_ds.runtime.setup import cost_model
from disttrain_ds.samples import PackedSample, SampleStats

Item = tuple[int, int]
"""(slot position of the sample, index of the item among the sample's items of that modality)."""


@dataclass(frozen=True)
class SlotPlan:
    """Who holds what of one microbatch slot."""

    samples: dict[str, list[list[int]]]
    """Every module but the encoders: each replica's sample positions (ascending)."""
    items: dict[str, list[list[Item]]]
    """Every encoder: each replica's items (ascending)."""
    llm: str
    """The LLM's name (whose replica of a sample receives its items' rows)."""

    def edge_owners(self, up: str, down: str) -> tuple[list[int], list[int]]:
        """The (upstream, downstream) replica of each unit the boundary ``up`` -> ``down`` carries,
        in slot order: an encoder's items, or samples."""
        if up in self.items:
            units = sorted(i for part in self.items[up] for i in part)
            at = {i: r for r, part in enumerate(self.items[up]) for i in part}
            llm = owners_of(self.samples[down])
            return [at[i] for i in units], [llm[i[0]] for i in units]
        return owners_of(self.samples[up]), owners_of(self.samples[down])


def carriers(samples: list, base: int, items: list[Item], modality: str, slot: int) -> list[PackedSample]:
    """An encoder replica's microbatch: per sample it holds items of, that sample with only those
    items of ``modality`` (and none of another); a replica holding nothing gets one sample of the
    slot (one its host read) with no items, so it runs on zero rows."""
    field = "images" if modality == "image" else "audio"
    other = "audio" if modality == "image" else "images"
    by_pos: dict[int, list[int]] = {}
    for pos, j in items:
        by_pos.setdefault(pos, []).append(j)
    if not by_pos:
        held = next(s for s in samples[base:base + slot] if s is not None)
        return [replace(held, images=[], audio=[], gen_targets=[])]
    out = []
    for pos, js in sorted(by_pos.items()):
        s = samples[base + pos]
        out.append(replace(s, **{field: [s.inputs(modality)[j] for j in js], other: []}, gen_targets=[]))
    return out


class Placement:
    """Each module's replicas' samples and items, microbatch slot by slot, for one recipe."""

    def __init__(self, recipe: Recipe, spec, dps: dict[str, int]):
        self.spec, self.dps, self.slot = spec, dps, recipe.parallel.llm.dp * recipe.train.micro_batch
        self.balanced = recipe.parallel.post_balance
        self.share = recipe.parallel.post_balance_share
        self.costs = cost_model(recipe)
        self.llm = spec.name_of("llm")
        image = spec.encoder_of("image")
        self.patch = image.patch_size if image is not None else 1

    def plans(self, samples: list) -> list[SlotPlan]:
        """Per microbatch slot of the global batch ``samples``, who holds what."""
        return [self._plan(samples[g * self.slot:(g + 1) * self.slot]) for g in range(len(samples) // self.slot)]

    def _plan(self, slot: list) -> SlotPlan:
        block = {m: [list(b) for b in blocks(self.slot, dp)] for m, dp in self.dps.items()}
        samples, items, stats = {}, {}, None  # the slot's cost views, made once if a module needs them
        for m, dp in self.dps.items():
            if m in self.spec.encoders:
                units = self._items(slot, m)
                if self.balanced and dp > 1:
                    cost = self._item_costs(slot, m, units)
                    floor = 1 if len(units) >= dp else 0
                    groups = assign(cost, dp, floor, max(share_cap(len(units), dp, self.share), -(-len(units) // dp)))
                    items[m] = [[units[i] for i in g] for g in groups]
                else:
                    items[m] = [[u for u in units if u[0] in b] for b in block[m]]
            elif self.balanced and dp > 1 and m != self.llm:
                stats = self._stats(slot) if stats is None else stats
                samples[m] = assign([self.costs.module_cost(m, st) for st in stats], dp, 1,
                                    share_cap(self.slot, dp, self.share))
            else:
                samples[m] = block[m]
        return SlotPlan(samples, items, self.llm)

    def _items(self, slot: list, module: str) -> list[Item]:
        """The slot's items of ``module``'s modality; with ``data.read: host`` (no post-balancing) only
        those of the samples this host read: the two ends of a boundary both read the samples they
        share, and each orders the items they share the same way."""
        modality = self.spec.modality(module)
        return [(p, j) for p, s in enumerate(slot) if s is not None for j in range(len(s.inputs(modality)))]

    def _stats(self, slot: list) -> list[SampleStats]:
        return [s.stats(self.patch, self.spec.special) for s in slot]

    def _item_costs(self, slot: list, module: str, units: list[Item]) -> list[float]:
        cfg, fam = self.spec.config(module), self.spec.family(module)
        out = []
        for p, j in units:
            size = fam.item_size(cfg, slot[p].inputs(fam.modality)[j])
            stats = (SampleStats(0, (size,), 0) if fam.modality == "image" else SampleStats(0, (), 0, audio_frames=(size,)))
            out.append(self.costs.module_cost(module, stats))
        return out

    def loads(self, samples: list) -> dict[str, list[np.ndarray]]:
        """Every module but the LLM: its replicas' summed forward costs in each slot (what
        ``balance/<module>_load_*`` report)."""
        out: dict[str, list[np.ndarray]] = {m: [] for m in self.dps if m != self.llm}
        for g, plan in enumerate(self.plans(samples)):
            slot = samples[g * self.slot:(g + 1) * self.slot]
            stats = self._stats(slot)
            for m in out:
                if m in plan.items:
                    out[m].append(np.array([sum(self._item_costs(slot, m, part)) for part in plan.items[m]]))
                else:
                    out[m].append(np.array([sum(self.costs.module_cost(m, stats[p]) for p in part)
                                            for part in plan.samples[m]]))
        return out

"""Which samples of each microbatch slot every module's replicas hold in a step.

By default every module splits each slot into contiguous, equal blocks over its DP replicas. With
``parallel.post_balance`` every encoder and generator assigns the slot's samples to its replicas by
its own per-sample costs (``reorder/post_balance.py``), the same on every rank: the cost model and
the assignment are deterministic functions of the step's samples, which every rank reads whole.
"""

from __future__ import annotations

from disttrain_ds.comm.routes import blocks
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.reorder.post_balance import slot_groups
from disttrain_ds.runtime.setup import cost_model

Groups = dict[str, list[list[int]]]
"""Module name -> each replica's slot positions (ascending)."""


class Placement:
    """Each module's replicas' samples, microbatch slot by slot, for one recipe."""

    def __init__(self, recipe: Recipe, spec, dps: dict[str, int]):
        self.spec, self.dps, self.slot = spec, dps, recipe.parallel.llm.dp * recipe.train.micro_batch
        self.balanced = recipe.parallel.post_balance
        self.share = recipe.parallel.post_balance_share
        self.costs = cost_model(recipe) if self.balanced else None
        image = spec.encoder_of("image")
        self.patch = image.patch_size if image is not None else 1

    def groups(self, samples: list) -> list[Groups]:
        """Per microbatch slot of the global batch ``samples``, every module's replicas' positions."""
        n = len(samples) // self.slot
        if not self.balanced:
            same = {m: [list(b) for b in blocks(self.slot, dp)] for m, dp in self.dps.items()}
            return [same] * n
        per = self.costs.costs([s.stats(self.patch, self.spec.special) for s in samples])
        columns = {m: self.costs.column(m) for m in self.dps}
        keep = {self.spec.name_of("llm")}
        return [slot_groups(per[g * self.slot:(g + 1) * self.slot], columns, self.dps, keep, self.share)
                for g in range(n)]

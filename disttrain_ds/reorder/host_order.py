"""``data.reorder`` when each host reads only its share (``data.read: host``/``auto``).

Every step, each rank sends the per-module costs of the positions it counts (a few floats per
sample, no pixels) to rank 0; rank 0 computes one order of the whole batch in which every sample
stays on positions its own host reads (``reorder/host.py``) and broadcasts it, so every host
applies the same permutation to the samples it holds (computing it once means a search budget
that runs out can never make two hosts disagree). The exchange and the search run at the start
of the step on the trainer's ranks, not ahead in the producers as with whole-batch reading.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as tdist

from disttrain_ds.cost.graph_costs import as_graph_costs
from disttrain_ds.reorder.inter import batch_order
from disttrain_ds.samples import ShapeSpec, SpecialTokens


class HostOrder:
    """Callable ``samples -> samples`` for ``ProducedSource.order_with``."""

    def __init__(self, shape: ShapeSpec, special: SpecialTokens, labels: list[int], counted: list[int], group):
        self.shape, self.special, self.labels, self.counted, self.group = shape, special, labels, counted, group
        self.model = as_graph_costs(shape.cost_model)

    def order(self, samples: list) -> list[int]:
        """The whole batch's order, the same on every rank."""
        mine = self.model.costs([samples[p].stats(self.shape.patch_size, self.special) for p in self.counted])
        rank = tdist.get_rank()
        got = [None] * tdist.get_world_size() if rank == 0 else None
        tdist.gather_object((self.counted, mine), got, dst=0, group=self.group)
        out: list = [None]
        if rank == 0:
            per_module = np.zeros((len(samples), len(self.model.names)))
            for positions, costs in got:
                per_module[positions] = costs
            out[0] = batch_order(per_module, self.model, self.shape.dp_size, self.shape.micro_batch, self.labels)
        tdist.broadcast_object_list(out, src=0, group=self.group)
        return out[0]

    def __call__(self, samples: list) -> list:
        order = self.order(samples)
        moved = [samples[i] for i in order]
        if any((a is None) != (b is None) for a, b in zip(samples, moved)):  # a sample left its host
            raise RuntimeError("data.reorder: the host-constrained order moved a sample to a position this host does not read")
        return moved

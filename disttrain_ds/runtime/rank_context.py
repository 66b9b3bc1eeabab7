"""Who this rank is in a pipeline job and what it talks over, in one object.

Built once by the distributed entry (``runtime/distributed.py``) after the process groups, the
boundary channels and the stage's place in the global 1F1B are known, and handed to every piece of
wiring that needs them (the engine, the executor, the callbacks, the step record) instead of a
dozen positional arguments each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disttrain_ds.comm.p2p import P2P
from disttrain_ds.parallel.groups import ProcessGroups
from disttrain_ds.parallel.tensor_parallel import TPContext
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.schedule.onef1b import StagePlace
from disttrain_ds.topology import ModuleGrid, Topology


@dataclass(frozen=True)
class RankContext:
    """This rank's coordinates, device and process groups."""

    recipe: Recipe
    """The resolved recipe every rank runs."""
    topo: Topology
    """The job's rank map."""
    rank: int
    """Global rank."""
    world: int
    """Ranks in the job."""
    device: torch.device
    """The device this rank computes on."""
    names: list[str]
    """Every rank's label (``rank N (module, host)``), for messages that name a peer."""
    grid: ModuleGrid
    """This rank's module and its DP x PP x TP grid."""
    stage: int
    """Pipeline stage inside the module."""
    dp_index: int
    """Data-parallel replica inside the module."""
    tp_index: int
    """Tensor-parallel rank inside the stage."""
    place: StagePlace
    """Where the stage sits in the global 1F1B (first / last of its engine, neighbours, backward)."""
    groups: ProcessGroups
    """Every process group of the job, made by every rank in one order."""
    meta_group: Any
    """The gloo group for bookkeeping collectives (step figures, host names, run directory)."""
    tp: TPContext
    """This stage's tensor-parallel group and degree."""
    p2p: P2P
    """The boundary channels to other modules' ranks."""
    per_node: int = 1
    """Ranks on the host with the fewest (what adaptive SP groups count as inside one node)."""

    @property
    def slot(self) -> int:
        """Samples per microbatch slot: the LLM's DP degree times ``train.micro_batch``."""
        return self.recipe.parallel.llm.dp * self.recipe.train.micro_batch

    @property
    def label(self) -> str:
        """This rank's own label."""
        return self.names[self.rank]

"""A DeepSpeed pipeline grid that lives on a subset of the world's ranks.

Stock ``PipelineParallelGrid`` ignores its ``process_group``, uses world rank and size, asserts
the topology covers the whole world, and creates every group itself. Here the topology's ranks are
offset to the module's range and the grid takes its groups from the job's group plan
(``parallel/groups.py``: every rank made every group, in one order), so several pipelines share
one world under NCCL's eager and lazy start-ups alike.
"""

from __future__ import annotations

import contextlib
import functools

import torch.distributed as tdist
from deepspeed.runtime.pipe import module as ds_pipe_module
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

from disttrain_ds.topology import ModuleGrid

GRID_AXES = ("replica", "data", "pipe", "model")
"""The groups of a module's grid: one data-axis coordinate (pipe x model), and one per DeepSpeed axis."""

SEQ = "seq"
"""Axis name of a module's sequence-parallel groups (made only where SP > 1)."""


class OffsetTopology(PipeModelDataParallelTopology):
    """DeepSpeed's (pipe, data, model) topology whose ranks start at ``first_rank``; its data axis
    holds every replica's SP ranks (``ModuleGrid.data_coords``)."""

    def __init__(self, grid: ModuleGrid):
        super().__init__(num_pp=grid.pp, num_mp=grid.tp, num_dp=grid.data_size)
        self.first_rank = grid.first_rank
        self.mapping = {coord: rank + grid.first_rank for coord, rank in self.mapping.items()}


def grid_groups(grid: ModuleGrid) -> dict[str, list[list[int]]]:
    """The rank lists of every group of the module's grid, per axis of ``GRID_AXES`` (pure)."""
    topo = OffsetTopology(grid)
    return {
        "replica": [sorted(topo.get_axis_list(axis="data", idx=d)) for d in range(grid.data_size)],
        "data": topo.get_axis_comm_lists("data"),
        "pipe": topo.get_axis_comm_lists("pipe"),
        "model": topo.get_axis_comm_lists("model"),
    }


class SubsetGrid(PipelineParallelGrid):
    """``PipelineParallelGrid`` over an ``OffsetTopology`` with groups made beforehand."""

    def __init__(self, topology: OffsetTopology, process_group=None, groups=None):  # noqa: D401 - base signature
        """``groups``: this rank's group per axis, ``{axis: (ranks, handle)}`` (``ProcessGroups.module_axes``)."""
        if groups is None:
            raise RuntimeError("SubsetGrid needs the module's groups made beforehand (parallel/groups.py)")
        self.global_rank = tdist.get_rank()
        self._topo = topology
        self.world_size = topology.get_dim("pipe") * topology.get_dim("data") * topology.get_dim("model")
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()

        # "Model" groups in DeepSpeed's sense: all ranks of one DP replica (pipe x model).
        replica, self.ds_model_proc_group = groups["replica"]
        self.ds_model_world_size = len(replica)
        self.ds_model_rank = replica.index(self.global_rank)
        self.dp_groups = topology.get_axis_comm_lists("data")
        self.dp_group, self.dp_proc_group = groups["data"]
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = self._build_p2p_groups()
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        self.pp_group, self.pp_proc_group = groups["pipe"]
        self.model_groups = topology.get_axis_comm_lists("model")
        self.slice_group, self.slice_proc_group = groups["model"]
        self.mp_group = self.slice_group

    def _build_p2p_groups(self):
        lists = []
        for ranks in self._topo.get_axis_comm_lists("pipe"):
            for i, r in enumerate(ranks):
                lists.append([r, ranks[(i + 1) % len(ranks)]])
        return lists

    def _is_grid_valid(self):
        return True


@contextlib.contextmanager
def subset_grid_for_pipeline_module(groups: dict):
    """While building a ``PipelineModule``, make it construct a ``SubsetGrid`` on ``groups``."""
    original = ds_pipe_module.PipelineParallelGrid
    ds_pipe_module.PipelineParallelGrid = functools.partial(SubsetGrid, groups=groups)
    try:
        yield
    finally:
        ds_pipe_module.PipelineParallelGrid = original

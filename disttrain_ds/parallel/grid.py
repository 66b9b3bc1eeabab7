"""A DeepSpeed pipeline grid that lives on a subset of the world's ranks.

Stock ``PipelineParallelGrid`` ignores its ``process_group``, uses world rank and size, asserts
the topology covers the whole world, and creates every group with world-wide ``new_group`` calls.
Here the topology's ranks are offset to the module's range and every group is created among the
module's ranks only (``use_local_synchronization``), so several pipelines share one world.
"""

from __future__ import annotations

import contextlib
import functools

import torch.distributed as tdist
from deepspeed.runtime.pipe import module as ds_pipe_module
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

from ..topology import ModuleGrid


class OffsetTopology(PipeModelDataParallelTopology):
    """DeepSpeed's (pipe, data, model) topology whose ranks start at ``first_rank``."""

    def __init__(self, grid: ModuleGrid):
        super().__init__(num_pp=grid.pp, num_mp=grid.tp, num_dp=grid.dp)
        self.first_rank = grid.first_rank
        self.mapping = {coord: rank + grid.first_rank for coord, rank in self.mapping.items()}


def _local_group(ranks: list[int]):
    return tdist.new_group(ranks=sorted(ranks), use_local_synchronization=True)


class SubsetGrid(PipelineParallelGrid):
    """``PipelineParallelGrid`` over an ``OffsetTopology``: groups among the module's ranks only."""

    def __init__(self, topology: OffsetTopology, process_group=None, model_group=None):  # noqa: D401 - base signature
        """``model_group``: this rank's tensor-parallel group if the caller already made it (reused)."""
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
        self.ds_model_proc_group, self.ds_model_rank = None, -1
        for dp in range(self.data_parallel_size):
            ranks = sorted(topology.get_axis_list(axis="data", idx=dp))
            if self.global_rank in ranks:
                self.ds_model_proc_group = _local_group(ranks)
                self.ds_model_world_size = len(ranks)
                self.ds_model_rank = ranks.index(self.global_rank)
        self.dp_groups = topology.get_axis_comm_lists("data")
        for g in self.dp_groups:
            if self.global_rank in g:
                self.dp_group, self.dp_proc_group = g, _local_group(g)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = self._build_p2p_groups()
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        for ranks in self.pipe_groups:
            if self.global_rank in ranks:
                self.pp_group, self.pp_proc_group = ranks, _local_group(ranks)
        self.model_groups = topology.get_axis_comm_lists("model")
        for g in self.model_groups:
            if self.global_rank in g:
                self.slice_group = g
                self.slice_proc_group = model_group if model_group is not None else _local_group(g)
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
def subset_grid_for_pipeline_module(model_group=None):
    """While building a ``PipelineModule``, make it construct a ``SubsetGrid`` (reusing ``model_group``)."""
    original = ds_pipe_module.PipelineParallelGrid
    ds_pipe_module.PipelineParallelGrid = functools.partial(SubsetGrid, model_group=model_group)
    try:
        yield
    finally:
        ds_pipe_module.PipelineParallelGrid = original

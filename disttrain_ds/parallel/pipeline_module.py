"""A module's layers as a DeepSpeed ``PipelineModule`` on its own ranks: each layer built from its
seeded ``LayerDef`` and cut to this rank's TP shard, frozen layers without weight gradients, tied
weights one parameter on one stage or copies summed across two.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule

from disttrain_ds.models.layers import LayerDef, tie_parameters
from disttrain_ds.parallel.grid import OffsetTopology, subset_grid_for_pipeline_module
from disttrain_ds.parallel.sequence_parallel import SPContext, attach
from disttrain_ds.parallel.tensor_parallel import TPContext, mark_norm_owners, shard_layer
from disttrain_ds.parallel.tp_sequence import TPSeqContext
from disttrain_ds.parallel.tp_sequence import attach as attach_tp_seq


class DefSpec(LayerSpec):
    """A ``LayerSpec`` built by a seeded ``LayerDef`` builder."""

    def __init__(self, layer_def: LayerDef, tp: TPContext, sp: SPContext | None = None,
                 tp_seq: TPSeqContext | None = None):  # no super().__init__
        # A named subclass only so DeepSpeed's partition log lists layer names.
        self.layer_def, self.tp, self.sp, self.tp_seq = layer_def, tp, sp, tp_seq
        self.typename = type(layer_def.name, (torch.nn.Module,), {})
        self.module_args, self.module_kwargs, self.global_rank = (), {}, -1

    def __repr__(self) -> str:
        return f"DefSpec({self.layer_def.name})"

    def build(self, log: bool = False) -> torch.nn.Module:
        # Built whole from its seed, cut to this rank's tensor-parallel shard, given its SP group.
        return attach_tp_seq(attach(shard_layer(self.layer_def.build(), self.tp), self.sp), self.tp_seq)


def recompute(function, *args):
    """Activation checkpointing of one block of layers: keep its inputs, run it again in
    backward. torch's non-reentrant checkpoint: inputs that need no gradient (token ids, frozen
    layers' outputs) and layers without trainable weights are fine, and the RNG state is
    replayed, so the recomputed forward is the forward that ran."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def build_pipeline_module(grid, layer_defs: list[LayerDef], partition: str, tp: TPContext, groups: dict,
                          checkpoint_every: int = 0, tied_group=None, sp: SPContext | None = None,
                          tp_seq: TPSeqContext | None = None) -> PipelineModule:
    """A PipelineModule holding only this rank's layers (its TP shards), with a grid on the
    module's ranks and this rank's groups of it (``groups``: ``ProcessGroups.module_axes``);
    layers whose ``LayerDef`` is frozen get no weight gradients.
    ``checkpoint_every``: recompute activations in blocks of that many layers (0: keep them).
    Tied weights (``LayerDef.ties``) are one parameter where both layers are on this stage; a copy
    whose partner is on another stage goes in ``pm.tied_copies``, its gradient summed over
    ``tied_group`` (``ProcessGroups.tied_group``) before each step. ``sp``: this rank's
    sequence-parallel group (``parallel/sequence_parallel.py``), None without SP. ``tp_seq``:
    sequence-sharded, overlapped TP (``parallel/tp_sequence.py``), None for replicated activations."""
    with subset_grid_for_pipeline_module(groups):  # the groups every rank made, not new ones
        pm = PipelineModule(
            layers=[DefSpec(d, tp, sp, tp_seq) for d in layer_defs],
            topology=OffsetTopology(grid),
            partition_method=partition,
            activation_checkpoint_interval=checkpoint_every,
            activation_checkpoint_func=recompute,
            dynamic_shape=True,  # images per sample vary, so activation shapes do too
        )
    for idx in range(pm._local_start, pm._local_stop):
        if layer_defs[idx].frozen:
            getattr(pm, str(idx)).requires_grad_(False)
    built = {layer_defs[i].name: getattr(pm, str(i)) for i in range(pm._local_start, pm._local_stop)}
    index = {d.name: i for i, d in enumerate(layer_defs)}
    # Every tie in PipelineModule's parameter names (``<layer index>.<param>``), follower -> leader:
    # what a resume under another layout reads a copy's optimizer state from.
    pm.tied_names = {f"{i}.{own}": f"{index[lead.split('/', 1)[0]]}.{lead.split('/', 1)[1]}"
                     for i, d in enumerate(layer_defs) for own, lead in d.ties}
    pm.tied_copies, pm.tied_group = [], tied_group
    for layer, param, follower in tie_parameters(built, layer_defs):
        if tied_group is None:
            raise RuntimeError(f"{layer}.{param} is tied to a layer on another stage, but this rank has no tied group")
        p = built[layer].get_parameter(param)
        p.ds_pipe_replicated = follower  # the gradient norm counts a tied weight once (the leader's copy)
        pm.tied_copies.append(p)
    mark_norm_owners(pm, tp)
    return pm

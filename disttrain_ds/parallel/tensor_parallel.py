"""Megatron-style tensor parallelism inside one module's pipeline layers.

Why this mechanism: every layer is first built whole from its seeded ``LayerDef`` (so initial
weights equal the reference's), then its attention and MLP linears are replaced by column/row
shards of those very weights. The process group is passed in explicitly, so several modules with
different TP degrees share one world; DeepSpeed's AutoTP and torch's ``parallelize_module`` both
want to own a device mesh over the whole job, which the disaggregated layout does not have.

Column-parallel linears split the output features (attention heads, MLP hidden units); the
following row-parallel linear splits its input features and all-reduces its partial sums. Around
them, activations are replicated on every TP rank: ``_CopyToTP`` (identity forward, all-reduce of
the input gradient backward) and ``_ReduceFromTP`` (all-reduce forward, identity backward) keep
replicated parameters' gradients equal on every TP rank, so DeepSpeed's DP all-reduce and
optimizer need no change. Convolutions split alike (output channels, then input channels), with a
GroupNorm between them holding whole groups of its rank's channels (a U-Net's ResNets). Layers
without a plan (embeddings, norms, other convolutions) stay replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain_ds.families import tp_plans
from disttrain_ds.models.projectors import MLPProjector


@dataclass(frozen=True)
class TPContext:
    """This rank's place in its tensor-parallel group."""

    group: object
    """Process group of the TP ranks (same module, stage and DP replica); None when size is 1."""
    rank: int
    """Index in the group (0 .. size-1)."""
    size: int
    """TP degree."""
    root: int = 0
    """Global rank of TP index 0 (the rank that talks across module boundaries)."""


def summed_over_tp(grad: torch.Tensor, group, fresh: bool = False) -> torch.Tensor:
    """A gradient summed over the TP ``group``. In place only where it is ``fresh`` (the input
    gradient of a linear or convolution, a new tensor); elsewhere autograd may hand this very tensor
    to another branch too (an add of two same-shaped inputs gives both the one gradient), which an
    in-place sum would corrupt, so the sum is made in a copy."""
    grad = grad.contiguous() if fresh else grad.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(grad, group=group)
    return grad


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, fresh: bool = False):
        ctx.group, ctx.fresh = group, fresh
        return x

    @staticmethod
    def backward(ctx, grad):
        return summed_over_tp(grad, ctx.group, ctx.fresh), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Every rank's ``x`` summed, where each rank reads the sum differently: all-reduce both ways."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return summed_over_tp(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None, None, None


def to_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """``x``, whole on every TP rank, entering a computation each rank does its share of: unchanged
    forward; backward sums the gradient over the group, so every rank holds the whole gradient."""
    return _CopyToTP.apply(x, tp.group)


def sum_over_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """The sum over the TP group of each rank's ``x`` (statistics of this rank's share of the
    tokens), read by every rank's own computation: its gradient is summed over the group too."""
    return _SumOverTP.apply(x, tp.group)


def shard_rows(t: torch.Tensor, rank: int, size: int, pieces: int = 1) -> torch.Tensor:
    """This rank's rows of ``t`` (dim 0), split within each of ``pieces`` equal stacked parts."""
    parts = t.chunk(pieces, dim=0)
    return torch.cat([p.chunk(size, dim=0)[rank] for p in parts], dim=0).clone()


def unshard_rows(shards: list[torch.Tensor], pieces: int = 1) -> torch.Tensor:
    """Inverse of ``shard_rows`` given every rank's shard in rank order."""
    split = [s.chunk(pieces, dim=0) for s in shards]
    return torch.cat([torch.cat([s[p] for s in split], dim=0) for p in range(pieces)], dim=0)


def merge_shards(parts: list[torch.Tensor], dim: int, pieces: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's shard of it (rank order): inverse of the column / row split."""
    return unshard_rows(parts, pieces) if dim == 0 else torch.cat(parts, dim=dim)


def tp_split(layer: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (split dim, stacked pieces) of each parameter ``shard_layer`` split in ``layer``."""
    return {n: (p.tp_dim, p.tp_pieces) for n, p in layer.named_parameters() if hasattr(p, "tp_dim")}


def _tp_param(t: torch.Tensor, dim: int, pieces: int = 1) -> nn.Parameter:
    p = nn.Parameter(t)
    # DeepSpeed's gradient-norm code counts parameters with this flag on every TP rank.
    p.tensor_model_parallel = True
    p.tp_dim, p.tp_pieces = dim, pieces
    return p


class ColumnParallelLinear(nn.Module):
    """``full`` with its output features split over the TP group; optionally gathers the output."""

    def __init__(self, full: nn.Linear, tp: TPContext, gather_output: bool = False, pieces: int = 1):
        super().__init__()
        out = full.out_features
        if out % (tp.size * pieces):
            raise ValueError(f"{out} output features do not split over tensor-parallel degree {tp.size}")
        self.tp, self.gather_output = tp, gather_output
        self.weight = _tp_param(shard_rows(full.weight.data, tp.rank, tp.size, pieces), 0, pieces)
        self.bias = None if full.bias is None else _tp_param(shard_rows(full.bias.data, tp.rank, tp.size, pieces), 0, pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_CopyToTP.apply(x, self.tp.group, True), self.weight, self.bias)
        return _GatherLastDim.apply(y, self.tp.group, self.tp.rank, self.tp.size) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``full`` with its input features split over the TP group; partial sums all-reduced."""

    def __init__(self, full: nn.Linear, tp: TPContext):
        super().__init__()
        if full.in_features % tp.size:
            raise ValueError(f"{full.in_features} input features do not split over tensor-parallel degree {tp.size}")
        self.tp = tp
        cols = full.weight.data.chunk(tp.size, dim=1)[tp.rank].clone()
        self.weight = _tp_param(cols, 1)
        # The bias is added once, after the reduction: replicated.
        self.bias = None if full.bias is None else nn.Parameter(full.bias.data.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """``full`` with its vocabulary rows split over the TP group: each rank looks up the ids in its
    rows (zeros elsewhere) and the partial embeddings are summed. Used where the embedding is tied
    to a vocabulary-split LM head, so both hold the same rows on every TP rank."""

    def __init__(self, full: nn.Embedding, tp: TPContext):
        super().__init__()
        rows = full.num_embeddings
        if rows % tp.size:
            raise ValueError(f"a vocabulary of {rows} does not split over tensor-parallel degree {tp.size}")
        self.tp, self.lo, self.hi = tp, tp.rank * rows // tp.size, (tp.rank + 1) * rows // tp.size
        self.weight = _tp_param(shard_rows(full.weight.data, tp.rank, tp.size), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        rows = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        return _ReduceFromTP.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.tp.group)


def _conv_args(full: nn.Conv2d, channels: int, tp: TPContext) -> dict:
    """``F.conv2d``'s arguments of ``full`` besides its weights, once its ``channels`` (in or out) are
    known to split over ``tp``; a convolution the split does not compute is refused."""
    if full.groups != 1 or full.padding_mode != "zeros" or channels % tp.size:
        raise ValueError(f"a convolution over {channels} channels (groups {full.groups}, padding {full.padding_mode}) "
                         f"does not split over tensor-parallel degree {tp.size}")
    return dict(stride=full.stride, padding=full.padding, dilation=full.dilation)


class ColumnParallelConv2d(nn.Module):
    """``full`` with its output channels split over the TP group (its input whole on every rank)."""

    def __init__(self, full: nn.Conv2d, tp: TPContext):
        super().__init__()
        self.tp, self.conv = tp, _conv_args(full, full.out_channels, tp)
        self.weight = _tp_param(shard_rows(full.weight.data, tp.rank, tp.size), 0)
        self.bias = None if full.bias is None else _tp_param(shard_rows(full.bias.data, tp.rank, tp.size), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(_CopyToTP.apply(x, self.tp.group, True), self.weight, self.bias, **self.conv)


class RowParallelConv2d(nn.Module):
    """``full`` with its input channels split over the TP group; partial sums all-reduced."""

    def __init__(self, full: nn.Conv2d, tp: TPContext):
        super().__init__()
        self.tp, self.conv = tp, _conv_args(full, full.in_channels, tp)
        self.weight = _tp_param(full.weight.data.chunk(tp.size, dim=1)[tp.rank].clone(), 1)
        # The bias is added once, after the reduction: replicated.
        self.bias = None if full.bias is None else nn.Parameter(full.bias.data.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.conv2d(x, self.weight, None, **self.conv), self.tp.group)
        return y if self.bias is None else y + self.bias[:, None, None]


class ChannelParallelGroupNorm(nn.Module):
    """``full`` on this rank's channels of a column-split activation: whole groups per rank, so each
    group's statistics are the unsplit norm's."""

    def __init__(self, full: nn.GroupNorm, tp: TPContext):
        super().__init__()
        if full.num_groups % tp.size:
            raise ValueError(f"{full.num_groups} norm groups do not split over tensor-parallel degree {tp.size}")
        self.groups, self.eps = full.num_groups // tp.size, full.eps
        self.weight = None if full.weight is None else _tp_param(shard_rows(full.weight.data, tp.rank, tp.size), 0)
        self.bias = None if full.bias is None else _tp_param(shard_rows(full.bias.data, tp.rank, tp.size), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)


PROJECTOR_PLAN = (MLPProjector, {"0": "col", "2": "row"})
"""The projectors' split, shared by every family (the families own theirs: ``Family.tp_plan``)."""


def _plans() -> list[tuple[type, Any]]:
    return [*tp_plans(), PROJECTOR_PLAN]


def _plan_for(module: nn.Module, plans: list[tuple[type, Any]]) -> dict[str, str] | None:
    for cls, plan in plans:
        if isinstance(module, cls):
            return plan(module) if callable(plan) else plan
    return None


def _set(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def shard_layer(layer: nn.Module, tp: TPContext) -> nn.Module:
    """Replace the planned linears, convolutions and group norms of ``layer`` (in place) by this
    rank's shards."""
    if tp.size == 1:
        return layer
    plans = _plans()
    for name, module in list(layer.named_modules()):
        plan = _plan_for(module, plans)
        if plan is None:
            continue
        for path, style in plan.items():
            if style == "divide":  # a head count: its processor derives the head size from it
                count = getattr(module, path)
                if count % tp.size:
                    raise ValueError(f"{name}: {count} attention heads do not split over tensor-parallel degree {tp.size}")
                setattr(module, path, count // tp.size)
                continue
            full = module.get_submodule(path)
            if style == "vocab":  # an embedding tied to a vocabulary-split head: split like it, or not at all
                if not isinstance(full, nn.Embedding):
                    raise TypeError(f"{name}.{path}: expected nn.Embedding to shard, found {type(full).__name__}")
                if full.num_embeddings % tp.size == 0:
                    _set(module, path, VocabParallelEmbedding(full, tp))
                continue
            if style == "groups":  # a GroupNorm between a column- and a row-split convolution
                _set(module, path, ChannelParallelGroupNorm(full, tp))
                continue
            if isinstance(full, nn.Conv2d) and style in ("col", "row"):
                _set(module, path, (ColumnParallelConv2d if style == "col" else RowParallelConv2d)(full, tp))
                continue
            if not isinstance(full, nn.Linear):
                raise TypeError(f"{name}.{path}: expected nn.Linear to shard, found {type(full).__name__}")
            if style == "col_gather" and full.out_features % tp.size:
                continue  # e.g. a vocabulary that does not split evenly: this head stays replicated
            if style == "row":
                new = RowParallelLinear(full, tp)
            else:
                new = ColumnParallelLinear(full, tp, gather_output=style == "col_gather",
                                           pieces=2 if style == "col_pairs" else 1)
            _set(module, path, new)
    return layer


def mark_norm_owners(module: nn.Module, tp: TPContext) -> None:
    """Make DeepSpeed's gradient norm count every parameter exactly once per DP replica.

    DeepSpeed counts a parameter when it is flagged model-parallel or when the rank is index 0
    of its (pipeline x tensor) group; with pipeline stages that would drop every later stage's
    parameters. Flag each stage's own parameters; replicated ones only on TP index 0."""
    for p in module.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            p.model_parallel = tp.rank == 0


def full_state(layer: nn.Module, tp: TPContext) -> dict[str, torch.Tensor]:
    """``layer.state_dict()`` with sharded parameters gathered back to full tensors (for export)."""
    state = {k: v.detach() for k, v in layer.state_dict().items()}
    if tp.size == 1:
        return state
    for name, p in layer.named_parameters():
        if not hasattr(p, "tp_dim"):
            continue
        parts = [torch.empty_like(p.data) for _ in range(tp.size)]
        dist.all_gather(parts, p.data.contiguous(), group=tp.group)
        state[name] = merge_shards(parts, p.tp_dim, p.tp_pieces)
    return state

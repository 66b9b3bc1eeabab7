"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) inside one module.

The ranks of one SP group hold the same samples, each a contiguous 1/SP slice of every sequence.
Everything outside attention works on the slice; around attention, an all-to-all trades the
sequence split for a head split, so each rank attends over whole sequences with 1/SP of the
heads, and a second all-to-all trades back. Document masking therefore stays exact: attention
sees every position of a row, under the row's whole ``doc_ids``.

The all-to-all with equal chunks is its own inverse, so its backward is the same exchange on the
gradient. The process group is passed in explicitly (``SPContext``), so it can differ between
modules and between microbatches.

Gradient scale: SP ranks sit inside DeepSpeed's data axis, which averages gradients over DP x SP
ranks, while the ranks of one SP group hold the same samples. Each SP rank's gradient entry points
(its slice's loss, a boundary gradient it injects) are therefore multiplied by SP (``grad_factor``),
which turns that average over DP x SP back into the average over DP that the loss normalisation
expects; a gradient that leaves the group for an upstream module is divided by it again
(``from_lead``), since upstream engines average over their own replicas only. Adaptive groups
(``sp: auto``) need no factor: there the norms count every rank of the data axis as a replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 in ``size`` equal chunks; backward: the same exchange (self-inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, drop_grad: bool):
        ctx.group, ctx.drop_grad = group, drop_grad
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # drop_grad: a fault for tests only, the gradient left where it was computed.
        return (grad if ctx.drop_grad else _exchange(grad, ctx.group)), None, None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _GatherSeq(torch.autograd.Function):
    """All-gather of each rank's slice along ``dim``; backward: the gradients summed over the
    group, this rank's slice kept (a reduce-scatter, written so gloo runs it too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int, dim: int):
        ctx.group, ctx.rank, ctx.size, ctx.dim = group, rank, size, dim
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class _FromLead(torch.autograd.Function):
    """Broadcast from the group's first rank; backward: the gradients summed onto that rank and
    divided by the SP factor the losses carry (the others' inputs were placeholders and get none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, lead: int, is_lead: bool, size: int):
        ctx.group, ctx.is_lead, ctx.size = group, is_lead, size
        x = x.detach().clone().contiguous()
        if x.numel():  # every rank knows the shape: an empty one (no image rows) needs no message
            dist.broadcast(x, src=lead, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if grad.numel():
            dist.all_reduce(grad, group=ctx.group)
        return (grad / ctx.size if ctx.is_lead else torch.zeros_like(grad)), None, None, None, None


@dataclass(frozen=True)
class SPContext:
    """This rank's place in its sequence-parallel group, and the exchanges the model calls."""

    group: object
    """Process group of the SP ranks (same module, stage, DP replica and TP index)."""
    rank: int
    """Index in the group (0 .. size-1): which slice of every sequence this rank holds."""
    size: int
    """SP degree."""
    lead: int = 0
    """Global rank of SP index 0 (the rank that talks across module boundaries)."""
    drop_grad: bool = False
    """Tests only: the all-to-all's backward leaves the gradient unexchanged (a fault to catch)."""
    adaptive: bool = False
    """A group of adaptive SP (``sp: auto``): the module's data axis holds its ``dp`` ranks only and
    the loss norms count each of them as a replica, so no factor is needed (``grad_factor`` 1)."""

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    @property
    def grad_factor(self) -> int:
        """What each gradient entry point is multiplied by (module docstring)."""
        return 1 if self.adaptive else self.size

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous 1/SP slice of ``x`` along ``dim`` (the sequence)."""
        n = x.shape[dim]
        if n % self.size:
            raise ValueError(f"sequence length {n} is not divisible by sp {self.size}")
        return x.narrow(dim, self.rank * (n // self.size), n // self.size)

    def heads_to_seq(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each [B, H_i, S/SP, D] (all heads, this rank's slice) -> [B, H_i/SP, S, D] (its heads, whole
        rows), in one all-to-all for all of them (q, k and v travel together)."""
        b, _, s, d = xs[0].shape
        heads = [x.shape[1] for x in xs]
        if any(h % self.size for h in heads):
            raise ValueError(f"{heads} heads are not divisible by sp {self.size}")
        # [B, SP (destination rank), H_i/SP, s, D], joined along the heads of each destination.
        joined = torch.cat([x.reshape(b, self.size, h // self.size, s, d) for x, h in zip(xs, heads)], dim=2)
        got = _AllToAll.apply(joined.permute(1, 0, 2, 3, 4), self.group, self.drop_grad)  # [source slice, B, .., s, D]
        parts = got.split([h // self.size for h in heads], dim=2)
        return tuple(p.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * s, d) for p, h in zip(parts, heads))

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H/SP, D] (whole rows, its heads) -> [B, S/SP, H, D] (this rank's slice, all heads)."""
        b, s, h, d = x.shape
        chunks = x.reshape(b, self.size, s // self.size, h, d).permute(1, 0, 2, 3, 4)  # by destination slice
        got = _AllToAll.apply(chunks, self.group, self.drop_grad)  # [source rank = head chunk, B, s, H/SP, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, s // self.size, self.size * h, d)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's slice of ``x`` joined along ``dim`` (whole rows on every rank)."""
        return _GatherSeq.apply(x, self.group, self.rank, self.size, dim)

    def from_lead(self, x: torch.Tensor) -> torch.Tensor:
        """The lead's ``x`` on every rank (others pass a placeholder of the same shape and dtype)."""
        return _FromLead.apply(x, self.group, self.lead, self.is_lead, self.grad_factor)


def attach(layer: torch.nn.Module, sp: SPContext | None) -> torch.nn.Module:
    """Give every submodule that splits its sequence (a ``seq_parallel`` attribute) this rank's
    SP context; without SP (None or size 1) the layer is left as built."""
    if sp is not None and sp.size > 1:
        for m in layer.modules():
            if hasattr(m, "seq_parallel"):
                m.seq_parallel = sp
    return layer

"""Tensor parallelism with sequence-sharded activations, its collectives overlapped with GEMMs.

Megatron-LM's sequence parallelism (Korthikanti et al. 2022) done StepCCL-style: between decoder
blocks each TP rank keeps a contiguous 1/TP slice of every sequence. A column-parallel linear
all-gathers the slices and multiplies; a row-parallel linear multiplies and reduce-scatters back to
slices. Each all-gather + GEMM and GEMM + reduce-scatter runs in ``chunks`` pieces
(``comm/overlap.py``), so the collective of one piece proceeds while the GEMM of another runs
(on CUDA on a side stream, the host never blocks). The communication volume equals that of the
replicated layout's all-reduces (an all-reduce is a reduce-scatter plus an all-gather); what changes
is that the GEMMs hide it, and norms and residual adds run on 1/TP of the tokens.

Gradients. Replicated parameters inside the sharded region (RMSNorm weights, a row-parallel
linear's bias) see only this rank's tokens: their gradients are summed over the TP group by a
hook (``attach``), after which every TP rank holds the full, equal gradient, as in the replicated
layout, so DeepSpeed's DP all-reduce and gradient norm need no change. ``scatter``'s backward
all-gathers the slices' gradients and ``gather``'s takes this rank's slice, the exact adjoints.

The model code calls this context's methods (``TPSeqContext``); it never touches a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain_ds.comm.overlap import allgather_matmul, matmul_reducescatter
from disttrain_ds.models.layers import stacked_bias
from disttrain_ds.models.packed import host_sizes
from disttrain_ds.models.packed_sp import padded_rows
from disttrain_ds.parallel.tensor_parallel import TPContext, sum_over_tp, summed_over_tp, to_tp_region

# torch >= 2.10 renamed the flat-tensor collectives; older releases only have the long names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_seq(x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """Every rank's slice joined along ``dim`` (1: [B, s, ...] rows of sequences; 0: [s, ...]
    packed rows) -> ``size`` times as long."""
    xt = x.transpose(0, dim).contiguous()  # the sequence first: all-gather joins along dim 0
    out = xt.new_empty((size * xt.shape[0], *xt.shape[1:]))
    _ALL_GATHER(out, xt, group=group)
    return out.transpose(0, dim)


def _slice_seq(x: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    n = x.shape[dim] // size
    # A copy, never a view: a slice of packed rows (dim 0) is contiguous already, and a view would
    # keep the whole replicated tensor alive for as long as the slice is.
    return x.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)


class _Scatter(torch.autograd.Function):
    """Replicated [B, S, ...] -> this rank's [B, S/TP, ...] (``dim`` 1; 0: packed rows); backward
    all-gathers the slices' grads."""

    @staticmethod
    def forward(ctx, x, group, rank, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _slice_seq(x, rank, size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, ctx.size, ctx.dim), None, None, None, None


class _Gather(torch.autograd.Function):
    """This rank's [B, S/TP, ...] -> replicated [B, S, ...] (``dim`` 1; 0: packed rows); backward
    keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, rank, size, dim):
        ctx.rank, ctx.size, ctx.dim = rank, size, dim
        return _gather_seq(x, group, size, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _slice_seq(grad, ctx.rank, ctx.size, ctx.dim), None, None, None, None


class _Moments(torch.autograd.Function):
    """[B, s, G, C/G] -> (mean, sum of squared deviations from it) per [B, G], in float32; keeps
    only its input for backward (the deviations are recomputed there)."""

    @staticmethod
    def forward(ctx, x):
        x32 = x.float()
        mean = x32.mean(dim=(1, 3))
        m2 = (x32 - mean[:, None, :, None]).square().sum(dim=(1, 3))
        ctx.save_for_backward(x, mean)
        return mean, m2

    @staticmethod
    def backward(ctx, g_mean, g_m2):
        x, mean = ctx.saved_tensors
        n = x.shape[1] * x.shape[3]
        dev = x.float() - mean[:, None, :, None]
        return (g_mean[:, None, :, None] / n + 2 * g_m2[:, None, :, None] * dev).to(x.dtype)


class _ScaleShift(torch.autograd.Function):
    """[B, s, C] rows x -> x * scale + shift in float32, cast back to x's dtype (scale, shift:
    [B, 1, C] float32); keeps x and scale for backward, no float32 copy of x."""

    @staticmethod
    def forward(ctx, x, scale, shift):
        ctx.save_for_backward(x, scale)
        return (x.float() * scale + shift).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        g = grad.float()
        return (g * scale).to(x.dtype), (g * x.float()).sum(dim=1, keepdim=True), g.sum(dim=1, keepdim=True)


@dataclass(frozen=True)
class TPSeqContext:
    """Sequence-sharded tensor parallelism for one TP group (see the module docstring)."""

    tp: TPContext
    """The TP group (size > 1)."""
    chunks: int = 4
    """Pieces each all-gather + GEMM / GEMM + reduce-scatter is cut into (1: no overlap)."""
    _streams: dict = field(default_factory=dict, compare=False, repr=False)

    def _side(self, device: torch.device):
        """One side stream per CUDA device for the collectives (None elsewhere)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of every row of the replicated ``x`` [B, S, ...]."""
        if x.shape[1] % self.tp.size:
            raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor-parallel degree {self.tp.size} "
                             "(sequence-sharded tensor parallelism, parallel.modules.<m>.tp_overlap)")
        return _Scatter.apply(x, self.tp.group, self.tp.rank, self.tp.size, 1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Whole rows [B, S, ...] on every rank from each rank's slice [B, S/TP, ...]."""
        return _Gather.apply(x, self.tp.group, self.tp.rank, self.tp.size, 1)

    def scatter_packed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of packed rows [rows, ...] (an encoder's items one after
        another), zero rows appended to a multiple of the TP degree (``padded_rows``)."""
        pad = padded_rows(x.shape[0], self.tp.size) - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        return _Scatter.apply(x, self.tp.group, self.tp.rank, self.tp.size, 0)

    def gather_packed(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The packed rows of the items ``counts`` describes (rows per item, read once per
        microbatch: ``host_sizes``) on every rank from each rank's slice, the padding dropped."""
        return _Gather.apply(x, self.tp.group, self.tp.rank, self.tp.size, 0)[:sum(host_sizes(counts))]

    def _pieces(self, rows: int) -> int:
        """``chunks``, or fewer where a slice has fewer rows (packed items vary by microbatch)."""
        return max(1, min(self.chunks, rows))

    # Collectives on a side stream, left out of compiled graphs (compiled code around them breaks
    # into graphs before and after each).
    @torch.compiler.disable
    def column(self, x: torch.Tensor, linears: list[nn.Module], joined: bool = False) -> list[torch.Tensor]:
        """Column-parallel ``linears`` that read the same input: this rank's slice ``x`` [B, s, in]
        (or packed rows [s, in]) -> each linear's [B, S, out_i] over whole rows, one all-gather for
        all of them (their weight shards stacked into one GEMM, the stack not kept for backward);
        ``joined``: the outputs side by side in one tensor, not split."""
        rows = x if x.dim() == 2 else x.transpose(0, 1)  # the sequence first
        y = allgather_matmul(rows, [m.weight for m in linears], self.tp.group, self._pieces(rows.shape[0]),
                             validate=False, side_stream=self._side(x.device))
        y = y if x.dim() == 2 else y.transpose(0, 1)  # [B, S, sum out_i]
        if joined:
            bias = stacked_bias(linears, y)
            return [y if bias is None else y + bias]
        outs = y.split([m.weight.shape[0] for m in linears], dim=-1)
        return [o if m.bias is None else o + m.bias for o, m in zip(outs, linears)]

    @torch.compiler.disable
    def row(self, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        """Row-parallel ``linear`` on whole rows ``x`` [B, S, in / TP] (or packed rows [S, in / TP])
        -> this rank's slice [B, s, out] of the sum over ranks, plus the (replicated) bias."""
        rows = x if x.dim() == 2 else x.transpose(0, 1)
        y = matmul_reducescatter(rows, linear.weight, self.tp.group, self._pieces(rows.shape[0] // self.tp.size),
                                 validate=False, side_stream=self._side(x.device))
        y = y if x.dim() == 2 else y.transpose(0, 1)
        return y if linear.bias is None else y + linear.bias

    @torch.compiler.disable
    def replicated(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, whole on every TP rank (a generator's condition or modulation), read by computation
        on this rank's slice: unchanged forward, gradient summed over the TP group."""
        return to_tp_region(x, self.tp)

    def group_norm(self, part: torch.Tensor, norm: nn.GroupNorm) -> torch.Tensor:
        """``norm`` over whole images from this rank's slice ``part`` [B, s, C] of every image's token
        rows: each group's mean and variance are those of the whole image, from every rank's
        moments of its slice (one small all-reduce; combined as Chan et al.'s parallel variance, so
        no large mean cancels). Float32 statistics and affine, as the library's kernel."""
        b, s, c = part.shape
        g = norm.num_groups
        mean, m2 = _Moments.apply(part.view(b, s, g, c // g))
        # [TP, 2, B, G]: this rank's moments in its slot, zeros in the others'
        slots = F.pad(torch.stack([mean, m2])[None], (0, 0, 0, 0, 0, 0, self.tp.rank, self.tp.size - self.tp.rank - 1))
        every = sum_over_tp(slots, self.tp)  # traced into compiled graphs (as the slices' scatter / gather)
        means = every[:, 0]
        mu = means.mean(dim=0)
        var = (every[:, 1].sum(dim=0) + s * (c // g) * (means - mu).square().sum(dim=0)) / (s * (c // g) * self.tp.size)
        scale = torch.rsqrt(var + norm.eps)[..., None].expand(b, g, c // g)
        if norm.affine:
            scale = scale * norm.weight.float().view(g, c // g)
        shift = -mu[..., None] * scale
        if norm.affine:
            shift = shift + norm.bias.float().view(g, c // g)
        # The one full-size tensor kept for backward is the input, kept by the moments already.
        return _ScaleShift.apply(part, scale.reshape(b, 1, c), shift.reshape(b, 1, c))

    def sum_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A replicated parameter's gradient from this rank's tokens -> the sum over the TP group."""
        return summed_over_tp(grad, self.tp.group)


def attach(layer: nn.Module, ctx: TPSeqContext | None) -> nn.Module:
    """Give every submodule with a ``tp_seq`` attribute this context; a submodule that also sets
    ``tp_seq_region`` computes on slices, so its replicated trainable parameters get their
    gradients summed over the TP group. Without a context the layer is left as built."""
    if ctx is None:
        return layer
    hooked: set[int] = set()  # a region inside a region (a U-Net transformer's blocks): one sum each
    for m in layer.modules():
        if not hasattr(m, "tp_seq"):
            continue
        m.tp_seq = ctx
        if getattr(m, "tp_seq_region", False):
            for p in m.parameters():
                if p.requires_grad and not hasattr(p, "tp_dim") and id(p) not in hooked:
                    hooked.add(id(p))
                    p.register_hook(ctx.sum_grad)
    return layer

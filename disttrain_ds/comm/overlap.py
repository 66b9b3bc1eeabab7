"""Chunked all-gather + GEMM and GEMM + reduce-scatter, communication overlapped with compute.

Sequence-parallel tensor parallelism surrounds each column-parallel linear with an all-gather of
the sequence shards and each row-parallel linear with a reduce-scatter. Done naively the GPU idles
while the collective runs. Here the rows of each rank's shard are cut into ``chunks`` pieces: the
collective of chunk k+1 proceeds while the GEMM of chunk k runs (StepCCL-style pipelining).

Where the overlap comes from: on CUDA the collectives are issued on a dedicated side stream and
the compute stream waits on one event per chunk, so the host never blocks; on CPU (gloo) they are
async work handles run by gloo's threads, waited for right before the GEMM that needs them.

Exactness. The all-gather moves bits unchanged and every output row is the same dot product as in
the unchunked ``all_gather(x) @ W.T``, computed by a GEMM over fewer rows. Hence:
- ``chunks=1`` is bitwise equal to the unchunked reference;
- it is always bitwise equal to the same per-chunk GEMMs computed on contiguous chunk buffers;
- ``chunks>1`` is bitwise equal to the unchunked result whenever the GEMM kernel reduces the inner
  dimension in the same order whatever the row count (always for integer-valued data; common for
  CPU BLAS but not promised); cuBLAS picks kernels (split-K included) by shape, so in general the
  guarantee is agreement to rounding of the compute dtype (allclose at fp32 tolerance in fp32).
The reduce-scatter direction is bitwise too for 2 ranks (a + b == b + a); with more ranks the
collective's summation order may depend on the message size, giving fp32-rounding agreement.

Both functions take their process group explicitly and are differentiable: the backward of the
all-gather + GEMM is a GEMM + reduce-scatter and vice versa, both chunked the same way (weight
gradients are summed chunk by chunk, so they agree with the unchunked ones to rounding).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

GatherFn = Callable[[int, int, torch.Tensor], Any]
"""``(start, stop, out)``: fill ``out`` [world * (stop - start), ...] with rows start:stop of every
rank's shard, in rank order; returns a handle with ``wait()`` or None when already ordered."""

ScatterFn = Callable[[torch.Tensor, torch.Tensor], Any]
"""``(out, partial)``: reduce-scatter ``partial`` [world * rows, ...] into ``out`` [rows, ...];
returns a handle with ``wait()`` or None."""

# torch >= 2.10 renamed the flat-tensor collectives; older releases only have the long names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_bounds(rows: int, chunks: int, align: int = 1) -> list[tuple[int, int]]:
    """Split ``rows`` into ``chunks`` contiguous ``(start, stop)`` ranges covering 0..rows.

    Sizes are counted in units of ``align`` rows (e.g. 64 for tensor-core friendly GEMM shapes)
    and differ by at most one unit, larger ones first; only the last range may end off-alignment.
    """
    for name, value in (("rows", rows), ("chunks", chunks), ("align", align)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if chunks < 1 or align < 1:
        raise ValueError(f"chunks and align must be >= 1, got chunks={chunks} align={align}")
    units = -(-rows // align)
    if chunks > max(units, 1):
        raise ValueError(f"chunks={chunks} exceeds the {units} blocks of {align} row(s) in a {rows}-row shard")
    base, extra = divmod(units, chunks)
    bounds, start = [], 0
    for k in range(chunks):
        stop = min(start + (base + (k < extra)) * align, rows)
        bounds.append((start, stop))
        start = stop
    return bounds


def _side(device: torch.device, side_stream):
    """(side stream, compute stream) on CUDA, (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    return side_stream or torch.cuda.Stream(device), torch.cuda.current_stream(device)


def _finish_on_side(handle, side) -> Any:
    """After issuing on ``side``: make the side stream (not the host) wait, and mark it done."""
    if handle is not None:
        handle.wait()  # NCCL: a stream wait on the current (side) stream; the host goes on
    event = torch.cuda.Event()
    event.record(side)
    return event


def _await(handle, compute) -> None:
    if compute is not None:
        compute.wait_event(handle)
    elif handle is not None:
        handle.wait()


def gather_matmul(
    gather: GatherFn, world: int, shard: torch.Tensor, weight: torch.Tensor, chunks: int,
    *, align: int = 1, side_stream=None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``gathered @ weight.T`` with the gather of chunk k+1 in flight during chunk k's GEMM.

    ``shard`` [n, ..., in] gives this rank's shape (and its data to ``gather``); returns the output
    [world * n, ..., out] and the gathered chunk buffers (kept for a weight gradient).
    """
    n, rest = shard.shape[0], tuple(shard.shape[1:])
    bounds = chunk_bounds(n, chunks, align)
    side, compute = _side(shard.device, side_stream)
    if side is not None:
        side.wait_stream(compute)  # the shard was produced on the compute stream
    bufs, handles = [], []
    for start, stop in bounds:
        # Allocated on the compute stream, which waits for the side stream before any reuse.
        buf = shard.new_empty((world * (stop - start), *rest))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            handle = gather(start, stop, buf)
            handles.append(_finish_on_side(handle, side) if side is not None else handle)
        bufs.append(buf)
    if len(bounds) == 1:
        _await(handles[0], compute)
        return torch.matmul(bufs[0], weight.t()), bufs
    out = shard.new_empty((world * n, *rest[:-1], weight.shape[0]))
    view = out.view(world, n, *out.shape[1:])
    for (start, stop), buf, handle in zip(bounds, bufs, handles):
        _await(handle, compute)
        y = torch.matmul(buf, weight.t())
        view[:, start:stop].copy_(y.view(world, stop - start, *y.shape[1:]))
    return out, bufs


def matmul_scatter(
    scatter: ScatterFn, world: int, x: torch.Tensor, weight: torch.Tensor, chunks: int,
    *, align: int = 1, side_stream=None,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T)`` over dim 0 with chunk k's reduce-scatter in flight during
    chunk k+1's GEMM. ``x`` [world * n, ..., in] -> [n, ..., out]."""
    n = x.shape[0] // world
    bounds = chunk_bounds(n, chunks, align)
    side, compute = _side(x.device, side_stream)
    xv = x.view(world, n, *x.shape[1:])
    out = x.new_empty((n, *x.shape[1:-1], weight.shape[0]))
    handles, partials = [], []
    for start, stop in bounds:
        part = torch.matmul(xv[:, start:stop], weight.t())
        part = part.reshape(world * (stop - start), *part.shape[2:])
        if side is not None:
            side.wait_stream(compute)  # the partial GEMM must finish before it is sent
        with torch.cuda.stream(side) if side is not None else nullcontext():
            handle = scatter(out[start:stop], part)
            handles.append(_finish_on_side(handle, side) if side is not None else handle)
        partials.append(part)  # alive until the wait below
    for handle in handles:
        _await(handle, compute)
    return out


def _dist_gather(x: torch.Tensor, group) -> GatherFn:
    return lambda start, stop, out: _ALL_GATHER(out, x[start:stop], group=group, async_op=True)


def _dist_scatter(group) -> ScatterFn:
    return lambda out, part: _REDUCE_SCATTER(out, part, group=group, async_op=True)


def _check_operands(name: str, x: torch.Tensor, weight: torch.Tensor, chunks: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if x.dim() < 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: input of shape {tuple(x.shape)} does not end in the weight's {weight.shape[1]} "
                         "input features")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"{name}: input ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) "
                         "must share dtype and device")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{name}: chunks must be a positive integer, got {chunks!r}")


def _check_same_on_all_ranks(name: str, x: torch.Tensor, group) -> None:
    """Collectives need equal shapes on every rank: compare them first, so a mismatch is a clear
    error on every rank instead of a hang or a transport failure."""
    mine = torch.tensor([x.shape[0], x[0:1].numel()], dtype=torch.int64, device=x.device)
    everyone = torch.empty(dist.get_world_size(group) * 2, dtype=torch.int64, device=x.device)
    _ALL_GATHER(everyone, mine, group=group)
    rows, rest = everyone[0::2].tolist(), everyone[1::2].tolist()
    if len(set(rows)) > 1 or len(set(rest)) > 1:
        raise ValueError(f"{name}: every rank of the group must pass the same shape; rows per rank {rows}, "
                         f"elements per row {rest}")


def _stacked(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return weights[0] if len(weights) == 1 else torch.cat(weights)


class _AllGatherMatmul(torch.autograd.Function):
    """Over several weights sharing the input, one gather and one stacked GEMM; the stack is made
    again in backward rather than kept, so no weight copy outlives the forward."""

    @staticmethod
    def forward(ctx, x_shard, group, chunks, align, side_stream, *weights):
        world = dist.get_world_size(group)
        out, bufs = gather_matmul(_dist_gather(x_shard, group), world, x_shard, _stacked(weights), chunks,
                                  align=align, side_stream=side_stream)
        ctx.args = (group, world, chunks, align, side_stream, x_shard.shape[0])
        ctx.bufs = bufs if any(ctx.needs_input_grad[5:]) else None
        ctx.save_for_backward(*weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        group, world, chunks, align, side_stream, n = ctx.args
        weights = ctx.saved_tensors
        weight = _stacked(weights)
        grad_out = grad_out.contiguous()
        grad_x, grad_ws = None, [None] * len(weights)
        if ctx.needs_input_grad[0]:
            grad_x = matmul_scatter(_dist_scatter(group), world, grad_out, weight.t(), chunks,
                                    align=align, side_stream=side_stream)
        if ctx.bufs is not None:
            grad_w = _chunked_weight_grad(grad_out, ctx.bufs, world, n, chunks, align, gathered_is_grad=False)
            grad_ws = [g if need else None for g, need in
                       zip(grad_w.split([w.shape[0] for w in weights]), ctx.needs_input_grad[5:])]
        ctx.bufs = None
        return grad_x, None, None, None, None, *grad_ws


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, chunks, align, side_stream):
        world = dist.get_world_size(group)
        ctx.args = (group, world, chunks, align, side_stream, x.shape[0] // world)
        ctx.save_for_backward(x, weight)
        return matmul_scatter(_dist_scatter(group), world, x, weight, chunks, align=align, side_stream=side_stream)

    @staticmethod
    def backward(ctx, grad_out):
        group, world, chunks, align, side_stream, n = ctx.args
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # d(partial) on every rank is the all-gathered output gradient; reuse it for both grads.
        grad_x, bufs = gather_matmul(_dist_gather(grad_out, group), world, grad_out, weight.t(), chunks,
                                     align=align, side_stream=side_stream)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _chunked_weight_grad(x, bufs, world, n, chunks, align, gathered_is_grad=True)
        return (grad_x if ctx.needs_input_grad[0] else None), grad_w, None, None, None, None


def _chunked_weight_grad(full: torch.Tensor, bufs: list[torch.Tensor], world: int, n: int, chunks: int,
                         align: int, gathered_is_grad: bool) -> torch.Tensor:
    """Sum over chunks of grad^T @ input, pairing each gathered buffer with the matching rows of
    the full-length tensor (input gradient or input, whichever was not gathered)."""
    view = full.view(world, n, *full.shape[1:])
    total = None
    for (start, stop), buf in zip(chunk_bounds(n, chunks, align), bufs):
        rows = view[:, start:stop].reshape(-1, full.shape[-1])
        gathered = buf.reshape(-1, buf.shape[-1])
        grad, inp = (gathered, rows) if gathered_is_grad else (rows, gathered)
        part = grad.t() @ inp
        total = part if total is None else total + part
    return total


def allgather_matmul(
    x_shard: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], group, chunks: int = 1,
    *, validate: bool = True, align: int = 1, side_stream=None,
) -> torch.Tensor:
    """``all_gather(x_shard, dim 0) @ weight.T`` over ``group``, pipelined in ``chunks`` pieces.

    ``x_shard`` [n, ..., in] is this rank's sequence shard; ``weight`` [out, in] (a column-parallel
    shard of a linear layer), or several such weights that read the same input (e.g. Q, K and V):
    one gather, one GEMM over the weights stacked by rows, their outputs side by side. Returns
    [world * n, ..., out], rank r's rows at r*n .. (r+1)*n. Every rank must pass the same shape;
    ``validate`` checks it with one small collective (turn it off in hot loops once shapes are
    known). ``side_stream``: CUDA stream for the collectives (a pooled stream by default).
    Differentiable in ``x_shard`` and every weight.
    """
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    for w in weights:
        _check_operands("allgather_matmul", x_shard, w, chunks)
    x_shard = x_shard.contiguous()
    if validate:
        _check_same_on_all_ranks("allgather_matmul", x_shard, group)
    chunk_bounds(x_shard.shape[0], chunks, align)  # refuse a bad split before any communication
    if torch.is_grad_enabled() and (x_shard.requires_grad or any(w.requires_grad for w in weights)):
        return _AllGatherMatmul.apply(x_shard, group, chunks, align, side_stream, *weights)
    world = dist.get_world_size(group)
    out, _ = gather_matmul(_dist_gather(x_shard, group), world, x_shard, _stacked(weights), chunks,
                           align=align, side_stream=side_stream)
    return out


def matmul_reducescatter(
    x: torch.Tensor, weight: torch.Tensor, group, chunks: int = 1,
    *, validate: bool = True, align: int = 1, side_stream=None,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim 0)`` over ``group``, pipelined in ``chunks`` pieces.

    ``x`` [world * n, ..., in] is the full sequence with this rank's input features (row-parallel
    linear); returns this rank's [n, ..., out] rows of the sum over ranks. The reverse of
    :func:`allgather_matmul`; same ``validate``, ``align`` and ``side_stream``. Differentiable.
    """
    _check_operands("matmul_reducescatter", x, weight, chunks)
    x = x.contiguous()
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"matmul_reducescatter: {x.shape[0]} rows do not split over the group's {world} ranks")
    if validate:
        _check_same_on_all_ranks("matmul_reducescatter", x, group)
    chunk_bounds(x.shape[0] // world, chunks, align)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _MatmulReduceScatter.apply(x, weight, group, chunks, align, side_stream)
    return matmul_scatter(_dist_scatter(group), world, x, weight, chunks, align=align, side_stream=side_stream)

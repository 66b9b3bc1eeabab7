"""Chunked all-gather + GEMM and GEMM + reduce-scatter: chunk boundaries, issue order, and
exactness against unchunked references on two real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from rank_pool import run_ranks  # tests/ is on sys.path under pytest

from disttrain_ds.comm.overlap import chunk_bounds, gather_matmul

WORLD = 2
ROWS = 5  # per rank: chunk counts 2..4 give unequal chunks
IN, OUT = 16, 8


# --------------------------------------------------------------------------- chunk boundaries


@pytest.mark.parametrize("rows", range(0, 23))
def test_chunk_bounds_tile_the_rows_with_sizes_within_one_larger_first(rows):
    for chunks in range(1, max(rows, 1) + 1):
        bounds = chunk_bounds(rows, chunks)
        assert len(bounds) == chunks
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_chunk_bounds_align_puts_every_inner_boundary_on_a_multiple():
    assert chunk_bounds(1000, 4, align=64) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert chunk_bounds(130, 3, align=64) == [(0, 64), (64, 128), (128, 130)]
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]


@pytest.mark.parametrize("rows, chunks, align, match", [
    (4, 0, 1, "chunks and align must be >= 1"),
    (4, 5, 1, "chunks=5 exceeds the 4 blocks"),
    (130, 4, 64, "chunks=4 exceeds the 3 blocks of 64"),
    (4, 2, 0, "chunks and align must be >= 1"),
    (-1, 1, 1, "rows must be >= 0"),
    (4, 2.0, 1, "chunks must be an integer"),
])
def test_chunk_bounds_refuses_impossible_splits(rows, chunks, align, match):
    with pytest.raises(ValueError, match=match):
        chunk_bounds(rows, chunks, align)


# --------------------------------------------------------------------------- one process, fake gather


class _Handle:
    def __init__(self, log, k):
        self.log, self.k = log, k

    def wait(self):
        self.log.append(("wait", self.k))


def _fake_gather(full: torch.Tensor, world: int, log: list):
    """An all-gather over ``world`` emulated ranks whose shards are the row blocks of ``full``."""
    n = full.shape[0] // world

    def gather(start, stop, out):
        k = len([e for e in log if e[0] == "issue"])
        log.append(("issue", k))
        out.copy_(full.view(world, n, *full.shape[1:])[:, start:stop].reshape(out.shape))
        return _Handle(log, k)
    return gather


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_gather_matmul_places_rows_exactly_and_issues_every_chunk_before_the_first_wait(chunks):
    world, n = 3, 4
    g = torch.Generator().manual_seed(chunks)
    # Integer-valued fp32: every partial sum is exact, so any correct chunking is bitwise equal.
    full = torch.randint(-8, 8, (world * n, 2, IN), generator=g).float()
    weight = torch.randint(-8, 8, (OUT, IN), generator=g).float()
    log: list = []
    out, bufs = gather_matmul(_fake_gather(full, world, log), world, full[:n], weight, chunks)
    assert torch.equal(out, full @ weight.t())
    assert len(bufs) == chunks
    issues = [i for i, e in enumerate(log) if e[0] == "issue"]
    waits = [e[1] for e in log if e[0] == "wait"]
    assert len(issues) == chunks and max(issues) < min(i for i, e in enumerate(log) if e[0] == "wait")
    assert waits == list(range(chunks))


def test_gather_matmul_float_result_equals_per_chunk_gemms_and_unchunked_to_fp32_rounding():
    world, n, chunks = 2, 7, 3
    g = torch.Generator().manual_seed(0)
    full, weight = torch.randn(world * n, IN, generator=g), torch.randn(OUT, IN, generator=g)
    out, _ = gather_matmul(_fake_gather(full, world, []), world, full[:n], weight, chunks)
    view = full.view(world, n, IN)
    expected = torch.empty(world, n, OUT)
    for s, e in chunk_bounds(n, chunks):
        expected[:, s:e] = (view[:, s:e].reshape(-1, IN) @ weight.t()).view(world, e - s, OUT)
    assert torch.equal(out, expected.view(world * n, OUT))
    torch.testing.assert_close(out, full @ weight.t(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- two gloo ranks


def _data(seed: int, *shape, integer: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, shape, generator=g).float() if integer else torch.randn(*shape, generator=g)


def _cases(rank: int, group) -> dict:
    from disttrain_ds.comm.overlap import allgather_matmul, matmul_reducescatter

    out: dict = {}
    for mid in [(), (3,)]:
        for integer in (False, True):
            full = _data(1, WORLD * ROWS, *mid, IN, integer=integer)  # every rank's shard, rank order
            weight = _data(2, OUT, IN, integer=integer)
            shard = full.view(WORLD, ROWS, *mid, IN)[rank]
            for chunks in (1, 2, 3, 4):
                y = allgather_matmul(shard, weight, group, chunks)
                per_chunk = torch.empty(WORLD, ROWS, *mid, OUT)
                for s, e in chunk_bounds(ROWS, chunks):
                    # A contiguous copy, like the gather buffer: a strided view may take another kernel.
                    piece = full.view(WORLD, ROWS, *mid, IN)[:, s:e].reshape(WORLD * (e - s), *mid, IN).contiguous()
                    per_chunk[:, s:e] = (piece @ weight.t()).view(WORLD, e - s, *mid, OUT)
                ref = full @ weight.t()
                out[("ag", mid, integer, chunks)] = (
                    torch.equal(y, per_chunk.view_as(y)), torch.equal(y, ref), float((y - ref).abs().max()))
    # Reduce-scatter: rank r holds the full sequence with its own input features X_r and W_r.
    xs = [_data(10 + r, WORLD * ROWS, IN) for r in range(WORLD)]
    ws = [_data(20 + r, OUT, IN) for r in range(WORLD)]
    ref = sum(x @ w.t() for x, w in zip(xs, ws)).view(WORLD, ROWS, OUT)[rank]
    for chunks in (1, 2, 3, 4):
        y = matmul_reducescatter(xs[rank], ws[rank], group, chunks)
        per_chunk = torch.empty(ROWS, OUT)
        for s, e in chunk_bounds(ROWS, chunks):
            parts = [torch.matmul(x.view(WORLD, ROWS, IN)[:, s:e], w.t())[rank] for x, w in zip(xs, ws)]
            per_chunk[s:e] = parts[0] + parts[1]
        out[("rs", chunks)] = (torch.equal(y, per_chunk), float((y - ref).abs().max()))
    out["grads"] = _grad_errors(rank, group)
    for name, fn in (("uneven", lambda: allgather_matmul(torch.zeros(4 + rank, IN), torch.zeros(OUT, IN), group, 2)),
                     ("rows_not_split", lambda: matmul_reducescatter(torch.zeros(5, IN), torch.zeros(OUT, IN), group)),
                     ("too_many_chunks", lambda: allgather_matmul(torch.zeros(3, IN), torch.zeros(OUT, IN), group, 4))):
        try:
            fn()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _grad_errors(rank: int, group) -> dict:
    """Largest gradient error of both ops against single-process autograd on the whole problem."""
    from disttrain_ds.comm.overlap import allgather_matmul, matmul_reducescatter

    errs = {}
    # All-gather + GEMM, column-parallel: rank r owns W_r and upstream gradient G_r.
    full = _data(30, WORLD * ROWS, IN)
    ws = [_data(40 + r, OUT, IN) for r in range(WORLD)]
    gs = [_data(50 + r, WORLD * ROWS, OUT) for r in range(WORLD)]
    x_ref = full.clone().requires_grad_(True)
    w_ref = [w.clone().requires_grad_(True) for w in ws]
    sum(((x_ref @ w.t()) * g).sum() for w, g in zip(w_ref, gs)).backward()
    shard = full.view(WORLD, ROWS, IN)[rank].clone().requires_grad_(True)
    w = ws[rank].clone().requires_grad_(True)
    (allgather_matmul(shard, w, group, 3) * gs[rank]).sum().backward()
    errs["ag_x"] = float((shard.grad - x_ref.grad.view(WORLD, ROWS, IN)[rank]).abs().max())
    errs["ag_w"] = float((w.grad - w_ref[rank].grad).abs().max())
    # GEMM + reduce-scatter, row-parallel: rank r owns X_r, W_r; output rows of rank q get G_q.
    xs = [_data(60 + r, WORLD * ROWS, IN) for r in range(WORLD)]
    g_full = _data(70, WORLD * ROWS, OUT)
    x_ref = [x.clone().requires_grad_(True) for x in xs]
    w_ref = [w.clone().requires_grad_(True) for w in ws]
    (sum(x @ w.t() for x, w in zip(x_ref, w_ref)) * g_full).sum().backward()
    x = xs[rank].clone().requires_grad_(True)
    w = ws[rank].clone().requires_grad_(True)
    (matmul_reducescatter(x, w, group, 3) * g_full.view(WORLD, ROWS, OUT)[rank]).sum().backward()
    errs["rs_x"] = float((x.grad - x_ref[rank].grad).abs().max())
    errs["rs_w"] = float((w.grad - w_ref[rank].grad).abs().max())
    # Several weights on one gathered input (Q, K and V): each gets its own gradient.
    parts = [_data(80 + i, OUT // 2 * (i + 1), IN) for i in range(3)]
    x_ref = full.clone().requires_grad_(True)
    p_ref = [p.clone().requires_grad_(True) for p in parts]
    g_all = _data(90, WORLD * ROWS, sum(p.shape[0] for p in parts))
    ((x_ref @ torch.cat(p_ref).t()) * g_all).sum().backward()
    shard = full.view(WORLD, ROWS, IN)[rank].clone().requires_grad_(True)
    ps = [p.clone().requires_grad_(True) for p in parts]
    saved: list[tuple] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = allgather_matmul(shard, ps, group, 2)
    (y * g_all).sum().backward()
    # What backward keeps is the weights themselves, not a stacked copy of them (1.0 fails the test).
    errs["multi_stack_kept"] = float((sum(p.shape[0] for p in parts), IN) in saved)
    # Both ranks hold the same weights and output gradient: the input's gradient comes from both.
    errs["multi_x"] = float((shard.grad - WORLD * x_ref.grad.view(WORLD, ROWS, IN)[rank]).abs().max())
    for i, (p, r) in enumerate(zip(ps, p_ref)):
        errs[f"multi_w{i}"] = float((p.grad - r.grad).abs().max())
    return errs


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_ranks(_cases, WORLD, timeout=60)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("mid", [(), (3,)])
def test_allgather_matmul_on_gloo_is_bitwise_equal_to_the_per_chunk_gemms(two_ranks, chunks, mid):
    for rank in range(WORLD):
        same_as_chunks, same_as_unchunked, diff = two_ranks[rank][("ag", mid, False, chunks)]
        assert same_as_chunks, f"rank {rank}"
        assert diff < 1e-5, f"rank {rank}: {diff} from the unchunked GEMM"
        if chunks == 1:
            assert same_as_unchunked


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_allgather_matmul_on_integer_data_is_bitwise_equal_to_the_unchunked_gemm(two_ranks, chunks):
    for rank in range(WORLD):
        for mid in [(), (3,)]:
            assert two_ranks[rank][("ag", mid, True, chunks)][1], f"rank {rank} mid {mid}"


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_matmul_reducescatter_on_two_ranks_is_bitwise_equal_to_per_chunk_sums(two_ranks, chunks):
    for rank in range(WORLD):
        same, diff = two_ranks[rank][("rs", chunks)]
        assert same and diff < 1e-5, f"rank {rank}: diff {diff}"


def test_gradients_of_both_ops_match_single_process_autograd(two_ranks):
    for rank in range(WORLD):
        errs = two_ranks[rank]["grads"]
        assert max(errs.values()) < 1e-4, f"rank {rank}: {errs}"


def test_uneven_shards_are_refused_on_every_rank_with_the_row_counts(two_ranks):
    for rank in range(WORLD):
        msg = two_ranks[rank]["uneven"]
        assert msg.startswith("allgather_matmul: every rank of the group must pass the same shape"), msg
        assert "rows per rank [4, 5]" in msg


def test_bad_splits_are_refused_before_any_communication(two_ranks):
    for rank in range(WORLD):
        assert "5 rows do not split over the group's 2 ranks" in two_ranks[rank]["rows_not_split"]
        assert "chunks=4 exceeds the 3 blocks" in two_ranks[rank]["too_many_chunks"]

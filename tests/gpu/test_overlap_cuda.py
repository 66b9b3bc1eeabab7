"""CUDA paths of the chunked all-gather + GEMM: side-stream issue, event ordering, exactness, the
NCCL collectives, and the GPU benchmark scripts at tiny sizes. Skipped without enough GPUs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disttrain_ds.comm.overlap import chunk_bounds, gather_matmul, matmul_scatter

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: a GEMM that did not wait would read unfilled buffers


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _per_chunk(full: torch.Tensor, weight: torch.Tensor, world: int, chunks: int) -> torch.Tensor:
    n, k = full.shape[0] // world, full.shape[1]
    view = full.view(world, n, k)
    out = torch.empty(world, n, weight.shape[0], device=full.device, dtype=full.dtype)
    for s, e in chunk_bounds(n, chunks):
        out[:, s:e] = (view[:, s:e].reshape(-1, k).contiguous() @ weight.t()).view(world, e - s, -1)
    return out.view(world * n, -1)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_gather_matmul_issues_on_the_side_stream_and_gemms_wait_for_delayed_copies(no_tf32, chunks):
    _need_gpus(1)
    world, n, k = 4, 256, 512
    full = torch.randn(world * n, k, device="cuda")
    weight = torch.randn(384, k, device="cuda")
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    seen = []

    def gather(start, stop, out):
        seen.append(torch.cuda.current_stream())
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy lands late; only the event makes the GEMM wait
        out.copy_(full.view(world, n, k)[:, start:stop].reshape(out.shape), non_blocking=True)
        return None

    out, _ = gather_matmul(gather, world, full[:n], weight, chunks, side_stream=side)
    assert seen == [side] * chunks and side != compute
    assert torch.equal(out, _per_chunk(full, weight, world, chunks))
    torch.testing.assert_close(out, full @ weight.t(), rtol=1e-5, atol=1e-4)


def test_matmul_scatter_waits_for_delayed_side_stream_scatter_before_returning(no_tf32):
    _need_gpus(1)
    x, weight = torch.randn(512, 256, device="cuda"), torch.randn(128, 256, device="cuda")
    side = torch.cuda.Stream()

    def scatter(out, part):  # a one-rank "reduce-scatter": a late copy on the side stream
        assert torch.cuda.current_stream() == side
        torch.cuda._sleep(SLEEP_CYCLES)
        out.copy_(part, non_blocking=True)
        return None

    y = matmul_scatter(scatter, 1, x, weight, 4, side_stream=side)
    assert torch.equal(y, _per_chunk(x, weight, 1, 4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from disttrain_ds.comm.overlap import allgather_matmul, matmul_reducescatter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=world)
    group, n, k = dist.group.WORLD, 96, 256
    g = torch.Generator().manual_seed(0)
    full = torch.randn(world * n, k, generator=g).cuda()
    weight = torch.randn(64, k, generator=g).cuda()
    result = {}
    for chunks in (1, 2, 3):
        y = allgather_matmul(full.view(world, n, k)[rank], weight, group, chunks)
        result[("ag", chunks)] = (torch.equal(y, _per_chunk(full, weight, world, chunks)),
                                  float((y - full @ weight.t()).abs().max()))
        z = matmul_reducescatter(full, weight, group, chunks)  # same X, W on all ranks: sum = world * X W^T
        result[("rs", chunks)] = float((z - world * (full @ weight.t()).view(world, n, -1)[rank]).abs().max())
    x = full.view(world, n, k)[rank].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    allgather_matmul(x, w, group, 3).square().sum().backward()
    x_ref, w_ref = full.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    (x_ref @ w_ref.t()).square().sum().backward()
    # Every rank holds the same W, so the reduce-scatter sums world identical gradient copies.
    ref_x = world * x_ref.grad.view(world, n, k)[rank]
    result["grad_x"] = float((x.grad - ref_x).abs().max() / ref_x.abs().max())
    result["grad_w"] = float((w.grad - w_ref.grad).abs().max() / w_ref.grad.abs().max())
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_allgather_matmul_and_reverse_on_nccl_match_references(tmp_path):
    _need_gpus(2)
    import torch.multiprocessing as torch_mp

    torch_mp.spawn(_nccl_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for chunks in (1, 2, 3):
            same, diff = res[("ag", chunks)]
            assert same and diff < 1e-3, (rank, chunks, diff)
            assert res[("rs", chunks)] < 1e-3, (rank, chunks)
        assert res["grad_x"] < 1e-5 and res["grad_w"] < 1e-5, res


@pytest.mark.parametrize("script, extra", [("gpu_modules.py", ["--peak-tflops", "100"]), ("gpu_comm_overlap.py", [])])
def test_bench_scripts_run_on_cuda_at_tiny_sizes(script, extra):
    _need_gpus(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--tiny", "--device", "cuda", *extra],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "skipped" not in proc.stdout and "|---|" in proc.stdout

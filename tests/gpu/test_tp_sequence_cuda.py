"""Tensor parallelism on sequence slices on CUDA + NCCL: the collectives on the side stream, the
GEMMs waiting on events, and the result equal to the unsharded layers. Skipped without 2 GPUs."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

import pytest
import torch
from tp_seq_cases import CASES, WORLD, case  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.gpu


def _worker(rank, port, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs, compared at fp32 tolerance
    try:
        dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank))
        out = {name: case(rank, dist.group.WORLD, *CASES[name], True, device=f"cuda:{rank}") for name in CASES}
        torch.cuda.synchronize()
        queue.put((rank, "ok", out))
    except Exception as exc:  # reported to the test, which asserts on it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_sequence_sharded_tp_on_nccl_gives_the_unsharded_loss_and_gradients():
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for _ in range(WORLD):
            rank, status, value = queue.get(timeout=300)
            assert status == "ok", f"rank {rank}: {value}"
            for name, got in value.items():
                assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-4), name
                assert got["grad_err"] < 1e-4, f"{name} rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()

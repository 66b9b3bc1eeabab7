"""A few real ranks in child processes (gloo on the CPU, NCCL with one GPU each) running one
function, their results or errors handed back to the test."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable

import torch


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        extra = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world, **extra)
        queue.put((rank, "ok", fn(rank, dist.group.WORLD, *args)))
    except Exception as exc:  # reported to the test, which asserts on it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args, backend: str = "gloo", start: str = "fork",
              timeout: float = 120) -> dict[int, Any]:
    """``fn(rank, group, *args)`` on ``world`` ranks; rank -> its return value (any rank's error fails)."""
    ctx = mp.get_context(start)
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            assert status == "ok", f"rank {rank}: {value}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results

"""How much communication the GPU hides behind compute: side-stream transfers and chunked all-gather + GEMM.

    python bench/gpu_comm_overlap.py [--part a|b|all]                  # one GPU
    torchrun --nproc_per_node=2 bench/gpu_comm_overlap.py               # >= 2 GPUs: real NCCL
    python bench/gpu_comm_overlap.py --device cpu --tiny                # CPU smoke run of the same logic

(a) Transfers on a side stream while GEMMs run on the compute stream. With one GPU the transfers
are pinned host<->device copies of activation-sized buffers (one H2D and one D2H per buffer) on a
side stream; under torchrun with >= 2 processes they are the communicator's own
``disttrain_ds.comm.p2p.P2P`` sends (ranks 2i -> 2i+1), whose side stream is the path under test.
The GEMM count is calibrated so compute takes ~1.25x the transfers. Reported: transfers alone,
compute alone, both together, and hidden = (t_comm + t_compute - t_both) / t_comm (goal >= 90%).

(b) ``disttrain_ds.comm.overlap``'s chunked all-gather + GEMM for chunks in {1, 2, 4, 8}. With one
GPU the all-gather of ``--tp`` shards is emulated by host->device copies of the other shards on
the side stream (PCIe, not NVLink: the ratio of transfer to GEMM differs from a real TP group);
under torchrun it is ``allgather_matmul`` on the real NCCL group. Reported: time per chunk count,
speedup over chunks=1 (the unchunked all-gather then GEMM), the gather and the GEMM alone.

Times are medians of ``--repeats`` wall-clock runs, each ended by a device synchronize. On CPU
the side stream is one worker thread (and gloo's threads under torchrun): the figures then only
show that the code runs. Without a CUDA device (and without ``--device cpu``) it prints
``skipped: no CUDA device``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.comm.overlap import allgather_matmul, chunk_bounds, gather_matmul  # noqa: E402

DTYPE = torch.bfloat16
HIDE_GOAL = 0.90
FULL = dict(act_mb=64.0, transfers=8, gemm=8192, tp=8, rows=1024, hidden=8192, out=28672)
TINY = dict(act_mb=0.25, transfers=4, gemm=128, tp=2, rows=16, hidden=64, out=64)


class _Future:
    def __init__(self, fut):
        self.fut = fut

    def wait(self) -> None:
        self.fut.result()


class Side:
    """The side queue: a CUDA stream, or on CPU one worker thread (ordered like a stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = None if self.stream is not None else ThreadPoolExecutor(max_workers=1)
        self._pending: list = []

    def submit(self, fn):
        """Run ``fn`` on the side queue; returns a handle with ``wait()`` (CPU) or None (CUDA)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                fn()
            return None
        handle = _Future(self._pool.submit(fn))
        self._pending.append(handle)
        return handle

    def sync(self) -> None:
        if self.stream is not None:
            torch.cuda.synchronize(self.device)
        for h in self._pending:
            h.wait()
        self._pending.clear()


def median_ms(fn, sync, repeats: int, warmup: int, barrier=None) -> float:
    """Median wall time of ``fn`` (each run ended by ``sync``), in milliseconds."""
    times = []
    for i in range(warmup + repeats):
        if barrier is not None:
            barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def hidden_fraction(t_comm: float, t_compute: float, t_both: float) -> float:
    """Share of the transfer time that ran under compute: (t_comm + t_compute - t_both) / t_comm."""
    if t_comm <= 0:
        raise ValueError(f"t_comm must be positive, got {t_comm}")
    return (t_comm + t_compute - t_both) / t_comm


def _host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locked on CUDA, so host<->device copies are asynchronous DMA transfers."""
    return t.pin_memory() if device.type == "cuda" else t


def _gemms(size: int, device: torch.device):
    a = torch.randn(size, size, device=device, dtype=DTYPE)
    b = torch.randn(size, size, device=device, dtype=DTYPE)
    c = torch.empty(size, size, device=device, dtype=DTYPE)

    def run(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b, out=c)
    return run


def _calibrated(gemm, t_comm: float, sync, args, agree=None) -> int:
    t_one = median_ms(lambda: gemm(1), sync, args.repeats, args.warmup)
    n = max(1, math.ceil(1.25 * t_comm / max(t_one, 1e-6)))
    return agree(n) if agree else n


def part_a(args, device: torch.device, sync, dist_ctx) -> dict:
    numel = int(args.act_mb * 2**20) // DTYPE.itemsize
    gemm = _gemms(args.gemm, device)
    if dist_ctx is None:
        side = Side(device)
        # Copy time does not depend on the values: constant fills are quicker to make than randn.
        host_src = [_host(torch.full((numel,), 0.5, dtype=DTYPE), device) for _ in range(args.transfers)]
        host_dst = [_host(torch.empty(numel, dtype=DTYPE), device) for _ in range(args.transfers)]
        dev_src = [torch.full((numel,), 0.5, device=device, dtype=DTYPE) for _ in range(args.transfers)]
        dev_dst = [torch.empty(numel, device=device, dtype=DTYPE) for _ in range(args.transfers)]

        def copies(i: int) -> None:
            dev_dst[i].copy_(host_src[i], non_blocking=True)
            host_dst[i].copy_(dev_src[i], non_blocking=True)

        def start() -> None:
            for i in range(args.transfers):
                side.submit(lambda i=i: copies(i))

        finish, all_sync, barrier, agree = (lambda: None), (lambda: (sync(), side.sync())), None, None
        path = ("pinned H2D+D2H copies on a side stream" if side.stream is not None
                else "CPU copies on a worker thread (smoke run)")
        moved = 2 * args.transfers * numel * DTYPE.itemsize
    else:
        start, finish, barrier, agree, path, moved = _p2p_comm(args, device, numel, dist_ctx)
        all_sync = sync
    t_comm = median_ms(lambda: (start(), finish()), all_sync, args.repeats, args.warmup, barrier)
    n = _calibrated(gemm, t_comm, sync, args, agree)
    t_compute = median_ms(lambda: gemm(n), sync, args.repeats, args.warmup, barrier)
    # Transfers are issued first (as the runtime does right after producing an activation), the
    # GEMMs queued behind them, and only then does the host wait for the transfers.
    t_both = median_ms(lambda: (start(), gemm(n), finish()), all_sync, args.repeats, args.warmup, barrier)
    return dict(path=path, bytes=moved, gemms=n, gemm_size=args.gemm, t_comm=t_comm, t_compute=t_compute,
                t_both=t_both, hidden=hidden_fraction(t_comm, t_compute, t_both))


def _p2p_comm(args, device, numel, dist_ctx):
    """Transfers through the project's communicator: rank 2i sends to 2i+1 (an odd last rank idles).
    Returns (start, finish, barrier, agree, path, bytes moved per pair)."""
    import torch.distributed as dist

    from disttrain_ds.comm.p2p import ACT, P2P, PeerInfo, new_channel_groups

    rank, world = dist_ctx
    p2p = P2P(new_channel_groups(world), rank, device, 300.0, PeerInfo({r: "bench" for r in range(world)}))
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    active = peer < world
    sender = rank % 2 == 0
    bufs = [torch.full((numel,), 0.5, device=device, dtype=DTYPE) for _ in range(args.transfers)]
    pending: list = []

    def start() -> None:
        if not active:
            return
        if sender:
            for b in bufs:
                p2p.isend(b, peer, ACT, "bench activation")
        else:  # shapes are known ahead, so every receive is posted at once, in sending order
            pending[:] = [p2p.irecv(b.shape, DTYPE, peer, ACT, "bench activation") for b in bufs]

    def finish() -> None:
        if not active:
            return
        if sender:
            p2p.flush_sends()
            return
        for p in pending:
            p.result()

    def agree(n: int) -> int:
        t = torch.tensor([n], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    moved = args.transfers * numel * DTYPE.itemsize
    path = f"P2P isend/irecv, {world} ranks ({dist.get_backend()})"
    return start, finish, dist.barrier, agree, path, moved


def part_b(args, device: torch.device, sync, dist_ctx) -> dict:
    chunks = [int(c) for c in args.chunks.split(",")]
    for c in chunks:
        chunk_bounds(args.rows, c)  # refuse a bad chunk count before any timing
    weight = (torch.randn(args.out, args.hidden, device=device) * 0.02).to(DTYPE)
    barrier = None
    if dist_ctx is None:
        world, side = args.tp, Side(device)
        shards = torch.randn(world, args.rows, args.hidden).to(DTYPE)
        mine = shards[0].to(device)
        path = f"emulated: {world} shards copied " + (
            "host->device on a side stream" if side.stream is not None else "on a worker thread (smoke run)")

        def runner(c: int):
            pieces = {b: _host(shards[:, b[0]:b[1]].contiguous(), device) for b in chunk_bounds(args.rows, c)}

            def gather(start, stop, out):
                src = pieces[(start, stop)].view(out.shape)
                if side.stream is not None:
                    out.copy_(src, non_blocking=True)  # issued on the side stream by gather_matmul
                    return None
                return side.submit(lambda: out.copy_(src))
            return lambda: gather_matmul(gather, world, mine, weight, c, side_stream=side.stream)[0]

        host_all = _host(shards.view(-1, args.hidden), device)
        gathered = host_all.to(device)
        gather_alone = lambda: side.submit(lambda: gathered.copy_(host_all, non_blocking=True))  # noqa: E731
        total_sync = lambda: (sync(), side.sync())  # noqa: E731
    else:
        import torch.distributed as dist

        rank, world = dist_ctx
        g = torch.Generator().manual_seed(rank)
        mine = torch.randn(args.rows, args.hidden, generator=g).to(device, DTYPE)
        allgather_matmul(mine, weight, dist.group.WORLD, 1, validate=True)  # equal shapes, once
        path, barrier, total_sync = f"{dist.get_backend()} all-gather, {world} ranks", dist.barrier, sync
        gathered = torch.randn(world * args.rows, args.hidden, device=device).to(DTYPE)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_alone = lambda: ag(gathered, mine)  # noqa: E731
        runner = lambda c: (lambda: allgather_matmul(mine, weight, dist.group.WORLD, c, validate=False))  # noqa: E731
    t_gather = median_ms(gather_alone, total_sync, args.repeats, args.warmup, barrier)
    t_gemm = median_ms(lambda: torch.matmul(gathered, weight.t()), sync, args.repeats, args.warmup, barrier)
    rows, ref = [], None
    for c in chunks:
        fn = runner(c)
        out = fn()
        total_sync()
        ref = out if ref is None else ref
        diff = float((out.float() - ref.float()).abs().max())
        rows.append(dict(chunks=c, ms=median_ms(fn, total_sync, args.repeats, args.warmup, barrier), max_diff=diff))
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
    return dict(path=path, world=world, shape=[args.rows, args.hidden, args.out], t_gather=t_gather,
                t_gemm=t_gemm, rows=rows)


def report_a(a: dict) -> str:
    verdict = "met" if a["hidden"] >= HIDE_GOAL else "MISSED"
    return "\n".join([
        f"(a) {a['path']}: {a['bytes'] / 2**20:.1f} MiB moved; compute = {a['gemms']} x bf16 GEMM {a['gemm_size']}^3",
        "| transfers ms | compute ms | both ms | hidden | goal |", "|---|---|---|---|---|",
        f"| {a['t_comm']:.3f} | {a['t_compute']:.3f} | {a['t_both']:.3f} | {a['hidden']:.1%} "
        f"| >= {HIDE_GOAL:.0%}: {verdict} |"])


def report_b(b: dict) -> str:
    n, k, o = b["shape"]
    lines = [f"(b) chunked all-gather + GEMM, {b['path']}: shard {n}x{k}, weight {o}x{k}, bf16; "
             f"gather alone {b['t_gather']:.3f} ms, GEMM alone {b['t_gemm']:.3f} ms, "
             f"perfect-overlap bound {max(b['t_gather'], b['t_gemm']):.3f} ms",
             "| chunks | ms | speedup vs 1 | max abs diff vs chunks=1 |", "|---|---|---|---|"]
    lines += [f"| {r['chunks']} | {r['ms']:.3f} | {r['speedup']:.2f}x | {r['max_diff']:.3g} |" for r in b["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=("a", "b", "all"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunks", default="1,2,4,8", help="(b) chunk counts; the first is the baseline")
    for key in FULL:
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(FULL[key]), default=None,
                        help=f"default {FULL[key]} ({TINY[key]} with --tiny)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here (rank 0)")
    args = ap.parse_args(argv)
    for key in FULL:
        if getattr(args, key) is None:
            setattr(args, key, (TINY if args.tiny else FULL)[key])
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    try:
        for c in args.chunks.split(","):
            chunk_bounds(args.rows, int(c))
    except ValueError as exc:
        raise SystemExit(f"--chunks/--rows: {exc}") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist_ctx, rank = None, 0
    if world >= 2:
        import torch.distributed as dist

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank = dist.get_rank()
        dist_ctx = (rank, world)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": name, "world": world}
    if rank == 0:
        print(f"device: {name}; {world} process(es); torch {torch.__version__}", flush=True)
    if args.part in ("a", "all"):
        results["a"] = part_a(args, device, sync, dist_ctx)
        if rank == 0:
            print(report_a(results["a"]), flush=True)
    if args.part in ("b", "all"):
        results["b"] = part_b(args, device, sync, dist_ctx)
        if rank == 0:
            print(report_b(results["b"]), flush=True)
    if rank == 0 and args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if dist_ctx is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

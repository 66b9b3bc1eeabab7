"""Several trainer ranks on one host: producers per rank (``data.share: rank``) vs one set of
producers for the host writing a shared spool (``data.share: node``).

Each "rank" is a process that asks for global batches of an MMC4 JSONL file (``--path``; real
image decode and resize, SmolLM2 BPE, packing) and then "computes" for ``--compute-ms`` (a sleep,
so the CPU is free for preprocessing). Prints per configuration, over the steps after the first (which includes
starting processes): the median wait for data per step over all ranks, the median rank's step
time, and the CPU seconds the whole process tree used per step (ranks, producers and
forkservers; read from /proc, Linux only).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_share.py --path mmc4_sample.jsonl --ranks 4 --compute-ms 300
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.data import spool  # noqa: E402
from disttrain_ds.data.config import DataConfig  # noqa: E402
from disttrain_ds.data.producers import build_source  # noqa: E402
from disttrain_ds.samples import GenShape, ShapeSpec  # noqa: E402

SHAPE = ShapeSpec(patch_size=14, gens=(GenShape(256, 3, 64),))
TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and every live descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(d.name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        stats[pid] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


def rank_main(rank: int, ranks: int, cfg: DataConfig, share: str, token: str, base: str, steps: int,
              compute_s: float, out) -> None:
    with build_source(cfg, SHAPE, 8, seed=0) as src:
        if share == "node":  # the bench process stands in for the leader's pid that readers watch
            src.share_with(spool.plan_shares([("host", os.getppid())] * ranks, token, Path(base))[rank])
        src.global_batch(0)  # includes starting processes: not measured
        time.sleep(compute_s)
        out.put(("ready", rank))
        waits, t0 = [], time.perf_counter()
        for step in range(1, steps + 1):
            src.global_batch(step)
            waits.append(src.last_wait_seconds)
            time.sleep(compute_s)
        out.put(("done", rank, waits, (time.perf_counter() - t0) / steps))
        if share == "node" and rank == 0:  # remove the spool once every rank has read the last batch
            while spool.consumed(src.share.directory, src.share.readers, -1) < steps:
                time.sleep(0.05)
            src.release_spool()


def run(cfg: DataConfig, ranks: int, share: str, steps: int, compute_s: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as base:
        token = f"bench{os.getpid()}{share}"
        procs = [ctx.Process(target=rank_main, args=(r, ranks, cfg, share, token, base, steps, compute_s, out))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        ready, done, cpu_start, cpu = 0, [], 0.0, 0.0
        while len(done) < ranks:  # sample the tree's CPU while its processes are alive
            now = tree_cpu_seconds(os.getpid())
            cpu = max(cpu, now)
            try:
                msg = out.get(timeout=0.25)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            if msg[0] == "ready":
                ready += 1
                if ready == ranks:  # every rank has its first batch: steady state from here
                    cpu_start = tree_cpu_seconds(os.getpid())
            else:
                done.append(msg)
        for p in procs:
            p.join()
    waits = [w for _, _, ws, _ in done for w in ws]
    return {"wait_ms": 1e3 * statistics.median(waits), "p90_ms": 1e3 * sorted(waits)[int(0.9 * (len(waits) - 1))],
            "step_ms": 1e3 * statistics.median(t for *_, t in done), "cpu_s_per_step": (cpu - cpu_start) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True, help="MMC4 JSONL file (e.g. the 107-document mmc4_sample.jsonl)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--producers", type=int, default=1, help="producers per rank (rank) or per host (node)")
    ap.add_argument("--compute-ms", type=float, default=300.0)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if not Path(args.path).is_file():
        raise SystemExit(f"--path: {args.path} not found")
    cfg = DataConfig(source="mmc4", path=args.path, tokenizer="smollm2", seq_len=2048, image_sizes=[224, 336, 448],
                     max_images=16, gen_images=[0, 2], producers=args.producers, queue_depth=4)
    print(f"{args.ranks} ranks on one host ({os.cpu_count()} CPUs), {args.producers} producer(s) per "
          f"rank or per host, compute {args.compute_ms:g} ms/step, {args.steps} steps after the first")
    print("| data.share | producer processes | median wait / step (ms) | p90 wait (ms) | step time (ms) | CPU s / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for share in ("rank", "node"):
        r = run(cfg, args.ranks, share, args.steps, args.compute_ms / 1e3)
        n = args.producers * (args.ranks if share == "rank" else 1)
        print(f"| {share} | {n} | {r['wait_ms']:.1f} | {r['p90_ms']:.1f} | {r['step_ms']:.0f} | {r['cpu_s_per_step']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()

"""Trainer-side wait for data: in-process preprocessing vs producer processes.

Reads an MMC4 JSONL file (``--path``) with real image decode and resize, tokenises with SmolLM2's BPE, packs
and (optionally) reorders, while a simulated trainer "computes" for ``--compute-ms`` per step.
Prints the median wait per step for each producer count (first batch excluded: it includes
process start-up, reported in its own column).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_preprocess.py --path mmc4_sample.jsonl --compute-ms 150
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import build_source
from disttrain_ds.samples import GenShape, ShapeSpec


def run(cfg: DataConfig, shape: ShapeSpec, batch: int, steps: int, compute_s: float) -> dict:
    waits = []
    with build_source(cfg, shape, batch, seed=0) as src:
        src.global_batch(0)
        first = src.last_wait_seconds
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            time.sleep(compute_s)  # the trainer's forward/backward: the CPU is free for producers
            src.global_batch(step)
            waits.append(src.last_wait_seconds)
        total = time.perf_counter() - t0
    return {"first": first, "median": statistics.median(waits), "p90": sorted(waits)[int(0.9 * (len(waits) - 1))],
            "step_s": total / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True, help="MMC4 JSONL file (e.g. the 107-document mmc4_sample.jsonl)")
    ap.add_argument("--compute-ms", type=float, default=150.0, help="simulated trainer compute per step")
    ap.add_argument("--steps", type=int, default=12, help="measured steps after the first")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--image-sizes", default="224,336,448", help="input image sides (multiples of --patch)")
    ap.add_argument("--patch", type=int, default=14)
    ap.add_argument("--gen-resolution", type=int, default=256)
    ap.add_argument("--producers", default="0,1,2", help="producer counts to compare")
    ap.add_argument("--tokenizer", default="smollm2")
    ap.add_argument("--reorder", action="store_true", help="also reorder each global batch in the producers")
    args = ap.parse_args()
    if not Path(args.path).is_file():
        raise SystemExit(f"--path: {args.path} not found")

    shape = ShapeSpec(patch_size=args.patch, gens=(GenShape(args.gen_resolution, 3, 64),))
    base = DataConfig(
        source="mmc4", path=args.path, tokenizer=args.tokenizer, seq_len=args.seq_len,
        image_sizes=[int(s) for s in args.image_sizes.split(",")], max_images=16, gen_images=[0, 2],
        queue_depth=4, reorder=args.reorder,
    )
    print(f"mmc4 {args.path}: global batch {args.global_batch}, seq_len {args.seq_len}, images {base.image_sizes} px, "
          f"tokenizer {args.tokenizer}, compute {args.compute_ms:.0f} ms/step, {args.steps} steps")
    print("| producers | median wait / step (ms) | p90 wait (ms) | step time (ms) | first batch (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(p) for p in args.producers.split(",")):
        r = run(dataclasses.replace(base, producers=n), shape, args.global_batch, args.steps, args.compute_ms / 1e3)
        print(f"| {n} | {1e3 * r['median']:.1f} | {1e3 * r['p90']:.1f} | {1e3 * r['step_s']:.1f} | {1e3 * r['first']:.0f} |")


if __name__ == "__main__":
    main()

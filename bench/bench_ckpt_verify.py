"""Cost of verifying checkpoint files (size + SHA-256, as resuming does), in seconds per GiB.

Writes ``--files`` torch files of ``--mib`` MiB each (random fp32 layer weights) under ``--dir``,
then times: the check of files in the page cache and of files evicted from it
(``posix_fadvise(DONTNEED)``), a plain read and ``torch.load(weights_only=True)`` of evicted files,
and SHA-256 vs BLAKE2b of cached files. Numbers for the development machine are in
docs/reliability.md (Cost).

    .venv/bin/python bench/bench_ckpt_verify.py --dir /tmp/ckpt_bench --files 32 --mib 64
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.checkpoint.files import file_entry, file_problem, safe_load  # noqa: E402


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(label: str, gib: float, work, paths: list[Path] | None = None) -> None:
    if paths is not None:
        evict(paths)
    t0 = time.perf_counter()
    work()
    dt = time.perf_counter() - t0
    print(f"{label:45s} {dt / gib:6.2f} s/GiB  ({gib:.2f} GiB in {dt:.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--files", type=int, default=32)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(args.files):
        p = args.dir / f"layer_{i:02d}-model_00-model_states.pt"
        if not p.exists() or p.stat().st_size < args.mib * 2**20:
            torch.save({"weight": torch.randn(args.mib * 2**20 // 4)}, p)
        paths.append(p)
    gib = sum(p.stat().st_size for p in paths) / 2**30
    entries = {p.name: file_entry(p) for p in paths}

    def verify() -> None:
        assert all(file_problem(args.dir, n, e) is None for n, e in entries.items())

    def read() -> None:
        for p in paths:
            with open(p, "rb") as f:
                while f.read(8 << 20):
                    pass

    def digest(name: str):
        def run() -> None:
            for p in paths:
                with open(p, "rb") as f:
                    hashlib.file_digest(f, name)
        return run

    timed("verify, files in the page cache", gib, verify)
    timed("verify, files not cached", gib, verify, paths)
    timed("plain read, files not cached", gib, read, paths)
    timed("torch.load(weights_only=True), not cached", gib, lambda: [safe_load(p) for p in paths], paths)
    for name in ("sha256", "blake2b"):
        timed(f"{name}, files in the page cache", gib, digest(name))


if __name__ == "__main__":
    main()

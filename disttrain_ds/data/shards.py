"""Shard lists: brace and glob patterns, the per-part split and the per-epoch visiting order.

A data set in shards (tar files, parquet files, sub-folders) is read in ``data.shard_parts``
parts. Part ``j`` of every global batch is packed only from the shards assigned to it, so whatever
computes part ``j`` opens those shards and no others. The assignment is a seeded permutation of the
shard list dealt round-robin: disjoint, covering, and the same in every process for a seed.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import numpy as np

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """``shards/{00000..00002}.tar`` -> the three names (zero padding kept); ``{a,b}`` lists too."""
    m = _BRACE.search(pattern)
    if not m:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end():]
    rng = _RANGE.match(body)
    if rng:
        lo, hi = int(rng.group(1)), int(rng.group(2))
        width = len(rng.group(1)) if rng.group(1).startswith("0") else 0
        step = 1 if hi >= lo else -1
        options = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    else:
        options = body.split(",")
    return [name for opt in options for name in expand_braces(head + opt + tail)]


def list_shards(pattern: str, suffixes: tuple[str, ...], key: str = "data.path") -> list[Path]:
    """Shard files named by ``pattern``: a file, a folder (its files with ``suffixes``, sorted), or
    brace / glob patterns. Every name a brace list spells out must exist; a glob must match."""
    out: list[Path] = []
    for name in expand_braces(pattern):
        p = Path(name).expanduser()
        if any(c in name for c in "*?["):
            found = sorted(Path(g) for g in glob.glob(str(p)) if Path(g).is_file())
            if not found:
                raise FileNotFoundError(f"{key}: {name} matches no file")
            out += found
        elif p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(suffixes))
            if not found:
                raise FileNotFoundError(f"{key}: no {' / '.join(suffixes)} files in {p}")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{key}: {name} does not exist")
    return out


def assign_shards(n_shards: int, parts: int, part: int, seed: int) -> list[int]:
    """Shard indices of ``part`` out of ``parts`` (ascending): a seeded deal of all shards."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} is not in 0..{parts - 1}")
    perm = np.random.default_rng([seed, 11]).permutation(n_shards)
    return sorted(int(s) for s in perm[part::parts])


def block_order(blocks: list[int], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Record order over consecutive blocks of sizes ``blocks`` (a shard, a row group): blocks in a
    seeded order, records shuffled within each block. Reading stays local to a block at a time."""
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)
    if not shuffle:
        return np.arange(int(starts[-1]), dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, 13])
    parts = [starts[b] + rng.permutation(blocks[b]) for b in rng.permutation(len(blocks))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

"""Where blob bytes live: keys of blob locations, positioned reads of shard files, parquet row
groups, and the pixel limit checked on headers. The lowest floor of the shard readers: ``tables.py``,
``hf_table.py`` and ``blobs.py`` build on it."""

from __future__ import annotations

import functools
import json
import os
from collections import OrderedDict


def key(*parts: object) -> str:
    """The key of a blob location."""
    return json.dumps(list(parts))


def cell_bytes(value: object) -> bytes | None:
    """Encoded bytes (an image, an audio clip) of a cell value (bytes, or a struct with ``bytes``), or None."""
    if isinstance(value, dict):
        value = value.get("bytes")
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


@functools.lru_cache(maxsize=64)
def _fd(path: str) -> int:
    return os.open(path, os.O_RDONLY)


def pread(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes of ``path`` at ``offset`` (descriptors cached per process)."""
    return os.pread(_fd(path), size, offset)


_GROUPS: OrderedDict[tuple[str, int], object] = OrderedDict()
_GROUPS_KEPT = 2
"""Row groups a process keeps decoded in memory (planning and decoding move through the same blocks)."""


def row_group(path: str, group: int):
    """A parquet row group as a pyarrow table (the last few kept: records are read group by group)."""
    k = (path, group)
    if k in _GROUPS:
        _GROUPS.move_to_end(k)
        return _GROUPS[k]
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path).read_row_group(group)
    _GROUPS[k] = table
    if len(_GROUPS) > _GROUPS_KEPT:
        _GROUPS.popitem(last=False)
    return table


def too_large(size: tuple[int, int], max_pixels: int) -> bool:
    """Whether a header's ``(width, height)`` is over ``max_pixels`` (0: no limit of ours)."""
    return max_pixels > 0 and size[0] * size[1] > max_pixels

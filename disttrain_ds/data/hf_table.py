"""Hugging Face ``datasets`` on disk, read offline: a ``save_to_disk`` folder, ``.arrow`` files or
``.parquet`` files (converted once into the Arrow cache under ``data.cache_dir``).

Rows are memory-mapped, so any row is read in place. ``Image`` and ``Audio`` columns are read
undecoded (their ``{"bytes", "path"}`` structs): pixels and clips are decoded by the producer that
prepares the step. The
table's shards, for the per-part split, are runs of ``ROWS_PER_SHARD`` consecutive rows.
"""

from __future__ import annotations

import functools
from pathlib import Path

from disttrain_ds.data import blob_io
from disttrain_ds.data.shards import list_shards
from disttrain_ds.data.tables import ShardTable, blob_cells

ROWS_PER_SHARD = 1024
"""Rows per shard of a ``datasets`` table (the unit of the per-part split and of shuffling)."""


def _undecoded(ds):
    import datasets

    for name, feature in ds.features.items():
        for kind in (datasets.Image, datasets.Audio):
            if isinstance(feature, kind):
                ds = ds.cast_column(name, kind(decode=False))
            elif isinstance(feature, datasets.List) and isinstance(feature.feature, kind):
                ds = ds.cast_column(name, datasets.List(kind(decode=False)))
    return ds


@functools.lru_cache(maxsize=8)
def open_dataset(path: str, cache_dir: str = ""):
    """The ``datasets.Dataset`` at ``path`` (image columns undecoded); one line naming ``data.path`` if not."""
    import datasets

    p = Path(path).expanduser()
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"data.path: {path} holds splits {sorted(ds)}, none named train; point at one split's folder")
                ds = ds["train"]
        else:
            files = [str(f) for f in list_shards(path, (".arrow", ".parquet"))]
            if all(f.endswith(".arrow") for f in files):
                ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
            elif all(f.endswith(".parquet") for f in files):
                ds = datasets.Dataset.from_parquet(files, cache_dir=cache_dir or None)
            else:
                raise ValueError(f"data.path: {path} mixes .arrow and .parquet files")
    finally:
        if bars:
            datasets.enable_progress_bars()
    return _undecoded(ds)


class HfTable(ShardTable):
    """Rows of a ``datasets`` table; a shard is ``ROWS_PER_SHARD`` consecutive rows."""

    def __init__(self, path: str, selected: list[int] | None = None, cache_dir: str = ""):
        self.path, self.cache_dir = path, cache_dir
        self.ds = open_dataset(path, cache_dir)
        n = len(self.ds)
        self.shards = [f"{path}[{a}:{min(a + ROWS_PER_SHARD, n)}]" for a in range(0, n, ROWS_PER_SHARD)]
        chosen = range(len(self.shards)) if selected is None else selected
        self._rows: list[int] = []
        self.blocks = []
        for s in chosen:
            rows = range(s * ROWS_PER_SHARD, min((s + 1) * ROWS_PER_SHARD, n))
            self._rows += rows
            self.blocks.append(len(rows))

    def record(self, index: int) -> tuple[dict, str]:
        row = self._rows[index]
        values = self.ds[row]
        out = {c: blob_cells(v, lambda i, c=c: blob_io.key("hf", self.path, self.cache_dir, row, c, i)) for c, v in values.items()}
        return out, f"{self.path}:row {row}"

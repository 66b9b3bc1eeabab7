"""Record tables over shards: webdataset tars, image folders and parquet files.

A table lists its format's shards (cheap: names only), then indexes only the shards it is given
(``selected``), so a part of the data set never touches the other parts' files. A record is a
mapping of field name -> value: text members as raw bytes, images and audio clips as ``BlobAt``
(where their bytes are; nothing decoded), parquet columns as Python values. Records are numbered shard by shard in
shard order; ``blocks`` gives the record count of each reading block (a shard, a row group).

Keys and members (webdataset / img2dataset layout): ``dir/000123.jpg``, ``dir/000123.txt`` and
``dir/000123.json`` are the members ``jpg``, ``txt``, ``json`` of key ``dir/000123`` (the key ends
at the base name's first dot, so ``000123.0.jpg`` is member ``0.jpg``). Members of one key must be
adjacent in a tar (as tar writers and img2dataset do); in a folder they sit side by side.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from disttrain_ds.data import blob_io
from disttrain_ds.data.shards import list_shards

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm"})
AUDIO_EXTS = frozenset({"wav", "npy"})
"""Members read by their location, not their bytes, beside images: .wav clips and .npy log-mel arrays."""


@dataclass(frozen=True)
class BlobAt:
    """Where a record's image or audio clip is: a file (``kind`` file) or bytes inside a shard (``kind`` blob)."""

    kind: str
    """file | blob."""
    key: str
    """Absolute file path, or a ``blobs`` key."""


def split_name(name: str) -> tuple[str, str]:
    """``dir/000123.0.jpg`` -> (``dir/000123``, ``0.jpg``): key and member extension."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower() if dot else ""


def is_media(ext: str) -> bool:
    """Whether a member with extension ``ext`` (``0.jpg``, ``wav``) is kept as a location (``BlobAt``)."""
    return ext.rpartition(".")[2] in IMAGE_EXTS | AUDIO_EXTS


class ShardTable:
    """Base: ``shards`` (all names), ``blocks`` (records per block), ``record(i)``."""

    shards: list[str]
    blocks: list[int]

    def __len__(self) -> int:
        return sum(self.blocks)

    def record(self, index: int) -> tuple[dict, str]:
        """(fields, where: shard and key for messages)."""
        raise NotImplementedError


class TarTable(ShardTable):
    """Uncompressed tar shards (webdataset, img2dataset ``output_format=webdataset``)."""

    SUFFIXES = (".tar",)

    def __init__(self, pattern: str, selected: list[int] | None = None, cache_dir: Path | None = None):
        self.shards = [str(p.resolve()) for p in list_shards(pattern, self.SUFFIXES)]
        chosen = range(len(self.shards)) if selected is None else selected
        self._rows: list[tuple[str, str, dict[str, tuple[int, int]]]] = []
        self.blocks = []
        for s in chosen:
            rows = self._cached_index(self.shards[s], cache_dir)
            self._rows += [(self.shards[s], key, {e: tuple(v) for e, v in members.items()}) for key, members in rows]
            self.blocks.append(len(rows))

    def _cached_index(self, path: str, cache_dir: Path | None) -> list:
        """``_index(path)``, kept as JSON under ``cache_dir`` keyed by path, size and mtime: every
        producer of every run opens the shard's index instead of walking its headers again."""
        if cache_dir is None:
            return self._index(path)
        st = os.stat(path)
        name = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
        cached = cache_dir / "tar_index" / f"{name}.json"
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError):
            pass
        rows = self._index(path)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=cached.parent, delete=False, suffix=".tmp") as f:
                json.dump(rows, f)
            os.replace(f.name, cached)  # atomic: producers starting together never read half a file
        except OSError:
            pass  # a read-only cache only costs the walk next time
        return rows

    @staticmethod
    def _index(path: str) -> list:
        """[key, {member extension: [data offset, size]}] per key, in tar order."""
        try:
            tf = tarfile.open(path, "r:")  # uncompressed only: members are read in place by offset
        except (tarfile.TarError, OSError) as exc:
            raise ValueError(f"data.path: {path} is not an uncompressed tar ({exc})") from None
        rows: list = []
        with tf:
            current, members = None, {}
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = split_name(m.name)
                if key != current:
                    if members:
                        rows.append([current, members])
                    current, members = key, {}
                members[ext] = [m.offset_data, m.size]
            if members:
                rows.append([current, members])
        return rows

    def record(self, index: int) -> tuple[dict, str]:
        path, key, members = self._rows[index]
        out: dict = {}
        for ext, (offset, size) in members.items():
            if is_media(ext):
                out[ext] = BlobAt("blob", blob_io.key("tar", path, offset, size))
            else:
                out[ext] = blob_io.pread(path, offset, size)
        return out, f"{path}:{key}"


class FolderTable(ShardTable):
    """A folder of files grouped by key (``a.jpg`` + ``a.txt`` [+ ``a.json``]); each folder holding
    files is one shard (img2dataset ``output_format=files`` writes ``00000/``, ``00001/`` ...)."""

    def __init__(self, root: str, selected: list[int] | None = None):
        base = Path(root).expanduser()
        if not base.is_dir():
            raise FileNotFoundError(f"data.path: {root} is not a folder")
        dirs = []
        for d, subdirs, files in os.walk(base):
            subdirs.sort()
            if any(not f.startswith(".") for f in files):
                dirs.append(Path(d).resolve())
        if not dirs:
            raise FileNotFoundError(f"data.path: no files in {root}")
        self.shards = [str(d) for d in sorted(dirs)]
        chosen = range(len(self.shards)) if selected is None else selected
        self._rows: list[tuple[str, str, dict[str, str]]] = []
        self.blocks = []
        for s in chosen:
            groups: dict[str, dict[str, str]] = {}
            for f in sorted(Path(self.shards[s]).iterdir()):
                if f.is_file() and not f.name.startswith("."):
                    key, ext = split_name(f.name)
                    groups.setdefault(key, {})[ext] = str(f)
            self._rows += [(self.shards[s], k, m) for k, m in groups.items()]
            self.blocks.append(len(groups))

    def record(self, index: int) -> tuple[dict, str]:
        folder, key, members = self._rows[index]
        out: dict = {}
        for ext, path in members.items():
            if is_media(ext):
                out[ext] = BlobAt("file", path)
            else:
                with open(path, "rb") as f:
                    out[ext] = f.read()
        return out, f"{folder}/{key}"


class ParquetTable(ShardTable):
    """Parquet files, a row per record; image and audio columns hold bytes or ``{"bytes": ...}``
    structs (img2dataset ``output_format=parquet``, Hugging Face image and audio columns). A row
    group is a block."""

    SUFFIXES = (".parquet",)

    def __init__(self, pattern: str, selected: list[int] | None = None):
        import pyarrow.parquet as pq

        self.shards = [str(p.resolve()) for p in list_shards(pattern, self.SUFFIXES)]
        chosen = range(len(self.shards)) if selected is None else selected
        self._groups: list[tuple[str, int, int]] = []  # (path, row group, first record index)
        self.blocks = []
        for s in chosen:
            try:
                meta = pq.ParquetFile(self.shards[s]).metadata
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for non-parquet files
                raise ValueError(f"data.path: {self.shards[s]} is not a parquet file ({exc})".splitlines()[0]) from None
            for g in range(meta.num_row_groups):
                self._groups.append((self.shards[s], g, len(self)))
                self.blocks.append(meta.row_group(g).num_rows)
        self._starts = [g[2] for g in self._groups]

    def record(self, index: int) -> tuple[dict, str]:
        g = bisect.bisect_right(self._starts, index) - 1
        path, group, start = self._groups[g]
        row = index - start
        table = blob_io.row_group(path, group)
        out: dict = {}
        for column in table.column_names:
            value = table.column(column)[row].as_py()
            out[column] = blob_cells(value, lambda i, c=column: blob_io.key("pq", path, group, row, c, i))
        return out, f"{path}:row {start - self._group_start(g) + row + 1}"

    def _group_start(self, g: int) -> int:
        """Record index of the first row of ``g``'s file."""
        path = self._groups[g][0]
        while g > 0 and self._groups[g - 1][0] == path:
            g -= 1
        return self._groups[g][2]


def blob_cells(value: object, key_of) -> object:
    """Byte cells (images, audio clips: bytes / bytes structs, alone or in a list) replaced by
    ``BlobAt`` locations."""
    if blob_io.cell_bytes(value) is not None:
        return BlobAt("blob", key_of(None))
    if isinstance(value, list) and any(blob_io.cell_bytes(v) is not None for v in value):
        return [BlobAt("blob", key_of(i)) if blob_io.cell_bytes(v) is not None else v for i, v in enumerate(value)]
    return value

"""Sources over sharded data sets: ``webdataset``, ``parquet``, ``folder``, ``hf``.

They pack and resume exactly as the JSON-lines sources do (``record_source.py``: a batch is a
pure function of seed and step; the data state in a checkpoint is the JSON cursor of the next
step), over a table of records read in place from the shards (``tables.py``, ``hf_table.py``).
Records are visited block by block (a shard or row group at a time, blocks in a seeded order,
records shuffled inside a block), so reading stays local to a few files.

With ``data.shard_parts: P`` the global batch of B sequences is packed in P parts of B / P
sequences; part j packs only the shards ``assign_shards`` deals to it (its own table, order and
cursor), so computing part j opens part j's shards alone.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.entry_parse import parse_entry
from disttrain_ds.data.fields import expected
from disttrain_ds.data.formats import Bad, Document
from disttrain_ds.data.hf_table import HfTable
from disttrain_ds.data.host_read import column_positions
from disttrain_ds.data.record_source import RecordSource
from disttrain_ds.data.shards import assign_shards, block_order
from disttrain_ds.data.source import SampleSource
from disttrain_ds.data.split import TRAIN, Split
from disttrain_ds.data.tables import FolderTable, ParquetTable, TarTable
from disttrain_ds.data.tokenizer import default_cache_dir
from disttrain_ds.errors import ConfigError
from disttrain_ds.samples import PackedSample, ShapeSpec

SHARD_SOURCES = ("webdataset", "parquet", "folder", "hf")
"""Values of ``data.source`` read by this module."""


def open_table(cfg: DataConfig, selected: list[int] | None = None):
    """The ``cfg.source`` table over the ``selected`` shards (None: all)."""
    if cfg.source == "webdataset":
        return TarTable(cfg.path, selected, default_cache_dir(cfg.cache_dir))
    if cfg.source == "parquet":
        return ParquetTable(cfg.path, selected)
    if cfg.source == "folder":
        return FolderTable(cfg.path, selected)

    return HfTable(cfg.path, selected, str(default_cache_dir(cfg.cache_dir) / "datasets"))


class ShardSource(RecordSource):
    """Packed samples from one part (or all) of a sharded data set."""

    _unused_keys = ()

    def __init__(self, cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int,
                 shards: list[int] | None = None, n_shards: int = 0, part: str = "", split: Split = TRAIN):
        self._selected, self._n_shards, self._part = shards, n_shards, part
        super().__init__(cfg, shape, global_batch, seed, cfg.source, Path(cfg.path).expanduser(), split)

    def _open_table(self):
        return open_table(self.cfg, self._selected)

    def _where(self) -> str:
        return f"data.path {self.cfg.path}{self._part} ({expected(self.cfg.fields)})"

    def _parse(self, record: int, rng: np.random.Generator) -> Document | Bad:
        fields, _ = self.table.record(int(record))
        return parse_entry(fields, self.cfg.fields, self.ctx, rng)

    def _permutation(self, epoch: int) -> np.ndarray:
        return block_order(self.table.blocks, self.seed, epoch, self.cfg.shuffle)

    def describe(self) -> str:
        return (f"{self.fmt} ({self.cfg.path}, {len(self.table.shards)} shards, {len(self.table)} records, "
                f"tokenizer {self.cfg.tokenizer}, seq_len {self.cfg.seq_len})")

    def _fingerprint(self) -> str:
        return super()._fingerprint() + self._part_suffix()

    def _known_fingerprints(self) -> set[str]:
        return {f + self._part_suffix() for f in super()._known_fingerprints()}

    def _part_suffix(self) -> str:
        return f"/{self._selected}" if self._selected is not None else ""


class PartedSource(SampleSource):
    """``data.shard_parts`` parts side by side: concatenated, part j holds indices j*B/P ..
    (j+1)*B/P - 1, which take the global positions ``column_positions`` gives them (part-major
    with one column per slot: positions j*B/P .. in order)."""

    def __init__(self, cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, split: Split = TRAIN):
        parts = cfg.shard_parts
        if global_batch % parts:
            raise ValueError(f"data.shard_parts: {parts} does not divide train.global_batch {global_batch}")
        n_shards = len(open_table(cfg, []).shards)  # names only: no shard is indexed
        if n_shards < parts:
            raise ValueError(f"data.shard_parts: {parts} parts but {cfg.path} has only {n_shards} shards")
        self.batch, self.per_part, self.cfg = global_batch, global_batch // parts, cfg
        self.positions = column_positions(global_batch, shape.slot(global_batch), shape.columns)
        self.parts: list[ShardSource | None] = [None] * parts
        self._args = (cfg, shape, self.per_part, n_shards)
        self.seed, self.split = seed, split  # each part holds out its share of its own records
        self._used: set[int] = set()  # parts read (part 0 is opened for its vocabulary alone)
        self._pending: dict[int, dict] = {}  # restored states of parts not opened yet (loaded when first read)
        self._restored: set[int] = set()  # opened parts given a restored state
        first = self.part(0)
        self.special, self.base_vocab = first.special, first.base_vocab

    def part(self, j: int) -> ShardSource:
        """Part ``j``'s source (opened, and its shards indexed, on first use)."""
        if self.parts[j] is None:
            cfg, shape, per_part, n = self._args
            shards = assign_shards(n, len(self.parts), j, self.seed)
            # Each part draws its own order and sizes: seed it apart from the others.
            self.parts[j] = ShardSource(cfg, shape, per_part, self.seed * 1000003 + j, shards, n,
                                        f", part {j + 1}/{len(self.parts)}", self.split)
        return self.parts[j]

    def describe(self) -> str:
        cfg, first = self.cfg, self.part(0)
        return (f"{cfg.source} ({cfg.path}, {first._n_shards} shards in {len(self.parts)} parts, each packed from "
                f"its own shards only; part 1: {len(first._selected)} shards, {len(first.table)} records; "
                f"tokenizer {cfg.tokenizer}, seq_len {cfg.seq_len})")

    def part_batch(self, step: int, j: int) -> list[PackedSample]:
        """The sequences of part ``j`` of ``step`` (reads part ``j``'s shards only)."""
        out = self.part(j).global_batch(step)
        for i, s in enumerate(out):
            s.sample_id = self.split.sample_id(step * self.batch + j * self.per_part + i)
        return out

    def global_batch(self, step: int) -> list[PackedSample]:
        got = self.read_units(step, list(range(len(self.parts))))
        return [got[p] for p in range(self.batch)]

    def units(self) -> list[list[int]]:
        n = self.per_part
        return [self.positions[j * n:(j + 1) * n] for j in range(len(self.parts))]

    def read_units(self, step: int, units: list[int]) -> dict[int, PackedSample]:
        out = {}
        for j in units:
            if j in self._pending:
                self.part(j).load_state_dict(self._pending.pop(j))
            self._used.add(j)
            for i, s in enumerate(self.part_batch(step, j)):
                out[self.positions[j * self.per_part + i]] = s
        return out

    def _opened(self) -> list[ShardSource]:
        """Parts read so far (a host reading some parts never plans the others)."""
        return [self.part(j) for j in sorted(self._used)]

    def step_skips(self, step: int) -> tuple[dict[str, int], dict[str, int]]:
        plan, extra = Counter(), Counter()
        for part in self._opened():
            p, e = part.step_skips(step)
            plan.update(p)
            extra.update(e)
        return dict(plan), dict(extra)

    def skip_counts(self) -> dict[str, int]:
        total = Counter()
        for part in self._opened():
            total.update(part.skip_counts())
        return dict(sorted(total.items()))

    def state_dict(self) -> dict:
        # A part this process never read is saved as unread: another host's state holds it.
        parts = [self.part(j).state_dict() if j in self._used | self._restored
                 else self._pending.get(j, {"kind": "unread", "next_step": 0}) for j in range(len(self.parts))]
        return {"kind": "parts", "parts": parts}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "parts" or len(state.get("parts", [])) != len(self.parts):
            raise ValueError("data: the checkpoint's data state was written for a different data setup (source, path, seed or packing)")
        if any(sub.get("kind") not in ("records", "unread") for sub in state["parts"]):
            raise ValueError("data: the checkpoint's data state was written for a different data setup (source, path, seed or packing)")
        self._used, self._pending, self._restored = set(), {}, set()
        for j, sub in enumerate(state["parts"]):
            if sub.get("kind") == "unread":
                continue
            if self.parts[j] is not None:  # part 0 at least: a state of another data setup is refused here
                self.parts[j].load_state_dict(sub)
                self._restored.add(j)
            else:
                self._pending[j] = sub  # checked against this setup when the part is first read


def open_shard_source(cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int,
                      split: Split = TRAIN) -> SampleSource:
    """The source for a shard format: one table, or ``data.shard_parts`` parts, reading ``split``."""
    if cfg.shard_parts < 1:
        raise ConfigError(f"data.shard_parts: must be >= 1, got {cfg.shard_parts}")
    if cfg.shard_parts == 1:
        return ShardSource(cfg, shape, global_batch, seed, split=split)
    return PartedSource(cfg, shape, global_batch, seed, split)

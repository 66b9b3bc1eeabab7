"""Sources over real records (``mmc4``, ``laion``, ``local``): plan, then decode on demand.

A step's batch is a pure function of (seed, step): the packing plan is computed once, in step
order, from token counts and image sizes only, and the cursor at the start of every planned step
is remembered. ``global_batch(step)`` plans up to ``step`` if needed and then decodes the images
of that step alone. ``state_dict`` carries the cursor of the next step (with the skip counts), so a
resumed run continues without re-reading the records before it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import asdict
from pathlib import Path

import numpy as np

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.fingerprint import data_fingerprint, known_fingerprints
from disttrain_ds.data.formats import Bad, Document, ParseContext, parse_record
from disttrain_ds.data.images import PHOTOS
from disttrain_ds.data.pack import Cursor, Packer, Piece, materialise
from disttrain_ds.data.reader import RecordTable, record_files
from disttrain_ds.data.source import SampleSource
from disttrain_ds.data.split import TRAIN, Split, split_records
from disttrain_ds.data.tokenizer import default_cache_dir, load_tokenizer, special_tokens
from disttrain_ds.samples import PackedSample, ShapeSpec

_DOC_CACHE = 4096
_PLAN_CACHE = 16


def check_shapes(cfg: DataConfig, shape: ShapeSpec) -> None:
    """Settings every image-producing source needs; one line naming the key."""
    for side in cfg.image_sizes:
        if side < shape.patch_size or side % shape.patch_size:
            raise ValueError(f"data.image_sizes: {side} is not a positive multiple of the encoder patch size {shape.patch_size}")
    if cfg.resolution_sampler not in ("independent", "square"):
        raise ValueError(f"data.resolution_sampler: must be independent or square, got {cfg.resolution_sampler!r}")
    if not 0.0 <= cfg.gen_prob <= 1.0:
        raise ValueError(f"data.gen_prob: must be in [0, 1], got {cfg.gen_prob}")


class RecordSource(SampleSource):
    """Packed samples from MMC4 / LAION / local records, with real decoded and resized pixels."""

    records_parsed: int
    """Records parsed so far in this process (a resumed run does not re-read the steps before it)."""
    _unused_keys: tuple[str, ...] = ("fields", "shard_parts")
    """``data`` keys these formats ignore (left out of the fingerprint: older checkpoints still match)."""

    def __init__(self, cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, fmt: str, path: Path,
                 split: Split = TRAIN):
        check_shapes(cfg, shape)
        for g in shape.gens:
            if g.channels != 3:
                raise ValueError(f"model.modules.{g.name or 'generator'}.in_channels: real data sources produce RGB targets (3), "
                                 f"got {g.channels}")
        self.cfg, self.shape, self.batch, self.seed, self.fmt, self.path = cfg, shape, global_batch, seed, fmt, path
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.cache_dir)
        self.base_vocab = tokenizer.vocab_size
        gens = shape.gens
        self.special = special_tokens(tokenizer, audio=shape.audio_mels > 0, generators=len(gens))
        self.table = self._open_table()
        if len(self.table) == 0:
            raise ValueError(f"data.path: no records in {path}")
        self.split = split
        self.records = split_records(len(self.table), split)  # the records this split reads
        self._in_split = np.zeros(len(self.table), dtype=bool)
        self._in_split[self.records] = True
        names = tuple(g.name for g in gens) if all(g.name for g in gens) else ()
        self.ctx = ParseContext(cfg, tokenizer, shape.patch_size, tuple(g.query_tokens for g in gens), seed,
                                shape.audio_mels, shape.audio_max_frames, names, self.special.bos)
        self.packer = Packer(self.ctx, len(self.records), self._doc, self._order, self._where())
        self._cursors: dict[int, Cursor] = {0: Cursor()}
        self._plans: OrderedDict[int, list[list[Piece]]] = OrderedDict()
        self._docs: OrderedDict[tuple[int, int], Document | Bad] = OrderedDict()
        self._perm: tuple[int, np.ndarray] | None = None
        self._decode_failures: dict[int, int] = {}
        self._served = -1
        self.records_parsed = 0

    def describe(self) -> str:
        line = f"{self.fmt} ({self.path}, {len(self.table)} records, tokenizer {self.cfg.tokenizer}, seq_len {self.cfg.seq_len})"
        if self.fmt in ("mmc4", "laion"):
            line += (f"; image URLs are not fetched: every image is a stand-in, one of {len(PHOTOS)} shipped "
                     f"photographs picked and cropped by a hash of its URL")
        return line

    # ----------------------------------------------------------------- records (hooks for other table kinds)

    def _open_table(self):
        """The records to pack (``len`` and ``[i]``)."""
        return RecordTable(record_files(self.path, "data.path"), default_cache_dir(self.cfg.cache_dir))

    def _where(self) -> str:
        """Names the data in errors (no usable records)."""
        return f"data.path {self.path}"

    def _parse(self, record: int, rng: np.random.Generator) -> Document | Bad:
        return parse_record(self.fmt, self.table[record], self.ctx, rng)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.table)
        return np.random.default_rng([self.seed, epoch, 7]).permutation(n) if self.cfg.shuffle else np.arange(n)

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            order = self._permutation(epoch)
            if len(self.records) < len(self.table):  # a hold-out: this split's records, in the same order
                order = order[self._in_split[order]]
            self._perm = (epoch, order)
        return self._perm[1]

    def _doc(self, epoch: int, record: int) -> Document | Bad:
        key = (epoch, record)
        if key in self._docs:
            self._docs.move_to_end(key)
            return self._docs[key]
        rng = np.random.default_rng([self.seed, epoch, record])  # sizes and choices per (epoch, record)
        doc = self._parse(record, rng)
        self.records_parsed += 1
        self._docs[key] = doc
        if len(self._docs) > _DOC_CACHE:
            self._docs.popitem(last=False)
        return doc

    # ----------------------------------------------------------------- planning

    def plan(self, step: int) -> list[list[Piece]]:
        """Pieces of each sequence of ``step`` (plans every earlier step not yet planned)."""
        if step in self._plans:
            self._plans.move_to_end(step)
            return self._plans[step]
        start = max(s for s in self._cursors if s <= step)
        for s in range(start, step + 1):
            cur, seqs = self._cursors[s], []
            for _ in range(self.batch):
                pieces, cur = self.packer.sequence(cur)
                seqs.append(pieces)
            self._cursors[s + 1] = cur
            self._plans[s] = seqs
            if len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        return self._plans[step]

    def global_batch(self, step: int) -> list[PackedSample]:
        seqs = self.plan(step)
        failures = 0

        def failed() -> None:
            nonlocal failures
            failures += 1

        out = [
            materialise(pieces, self._doc, self.ctx, self.special, tuple(g.resolution for g in self.shape.gens),
                        self.split.sample_id(step * self.batch + i), self.fmt, failed)
            for i, pieces in enumerate(seqs)
        ]
        if failures:
            self._decode_failures[step] = failures
        self._served = step
        return out

    # ----------------------------------------------------------------- accounting and state

    def step_skips(self, step: int) -> tuple[dict[str, int], dict[str, int]]:
        self.plan(step)
        plan = dict(self._cursors[step + 1].skips)
        extra = {"image_decode_failed": self._decode_failures[step]} if step in self._decode_failures else {}
        return plan, extra

    def skip_counts(self) -> dict[str, int]:
        if self._served < 0:
            return {}
        total = Counter(dict(self._cursors[self._served + 1].skips))
        total["image_decode_failed"] += sum(n for s, n in self._decode_failures.items() if s <= self._served)
        return {k: v for k, v in sorted(total.items()) if v}

    def _setup(self) -> tuple[list, dict, ShapeSpec, Split, tuple[str, ...]]:
        """What the data state's fingerprint hashes (``data/fingerprint.py``)."""
        head = [self.fmt, str(self.path), len(self.table), self.seed, self.batch]
        return head, asdict(self.cfg), self.shape, self.split, self._unused_keys

    def _fingerprint(self) -> str:
        return data_fingerprint(*self._setup())

    def _known_fingerprints(self) -> set[str]:
        return known_fingerprints(*self._setup())

    def state_dict(self) -> dict:
        nxt = self._served + 1
        cur = self._cursors[nxt]
        return {
            "kind": "records",
            "fingerprint": self._fingerprint(),
            "next_step": nxt,
            "cursor": {**asdict(cur), "skips": [list(kv) for kv in cur.skips]},
            "decode_failures": {str(s): n for s, n in self._decode_failures.items() if s < nxt},
        }

    def load_state_dict(self, state: dict) -> None:
        # States saved by earlier versions, in the layouts they hashed, still load.
        if state.get("kind") != "records" or state.get("fingerprint") not in self._known_fingerprints():
            raise ValueError("data: the checkpoint's data state was written for a different data setup (source, path, seed or packing)")
        nxt = int(state["next_step"])
        c = state["cursor"]
        self._cursors = {0: Cursor(), nxt: Cursor(c["epoch"], c["pos"], c["seg"], c["off"], tuple(tuple(kv) for kv in c["skips"]))}
        self._plans.clear()
        self._decode_failures = {int(s): int(n) for s, n in state.get("decode_failures", {}).items()}
        self._served = nxt - 1

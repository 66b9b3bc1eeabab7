"""Packing documents into fixed-length sequences, and turning a packing plan into tensors.

Layout of one sequence (``seq_len`` tokens)::

    [text ...] [boi] [image x patches] [eoi] [text ...] [boi] [gen x query_tokens] [eoi] [eod] [next doc ...] [pad ...]

Documents are placed greedily in record order. A caption pair never splits: when it does not fit
in what is left of the sequence, the sequence is closed (padded) and the pair starts the next one.
An interleaved document fills the sequence and continues in the next: it is split at an image
boundary, or inside a text run (an image never straddles two sequences). ``eod`` follows the last
piece of each document. Every piece is one entry of ``doc_lens``. Per sequence, at most
``data.max_images`` input images, ``data.gen_images[1]`` generated images and ``data.max_audio`` audio
clips are placed.

With ``data.max_seq_len`` above ``seq_len``, what is left of a document that does not fit an empty
``seq_len`` sequence closes the sequence being filled and opens one of its own: k x ``seq_len``
tokens, the fewest that hold it, at most ``max_seq_len`` (what still does not fit continues in the
next sequence), with k times the per-sequence image and clip limits; shorter documents fill the rest.
Lengths stay multiples of ``seq_len``, so few shapes reach the model and every SP degree that
divides ``seq_len`` divides them.

Planning needs only token counts and image sizes (no pixels), so every producer can plan all steps
cheaply and decode the images of its own steps only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from disttrain_ds.data import blobs
from disttrain_ds.data.audio import load_clip, load_clip_bytes
from disttrain_ds.data.config import longest_seq
from disttrain_ds.data.formats import AudioSeg, Bad, Document, ImageSeg, ParseContext, TextSeg, seg_cost
from disttrain_ds.data.images import load_image
from disttrain_ds.data.source import labels_for
from disttrain_ds.errors import ConfigError
from disttrain_ds.samples import PackedSample, SpecialTokens


@dataclass(frozen=True)
class Cursor:
    """Where packing resumes: the next unplaced part of the record stream."""

    epoch: int = 0
    """Pass over the records."""
    pos: int = 0
    """Position in this epoch's record order."""
    seg: int = 0
    """Next segment of the document at ``pos`` (non-zero when it was split)."""
    off: int = 0
    """Next token inside that segment (non-zero when a text run was split)."""
    skips: tuple[tuple[str, int], ...] = ()
    """Records skipped so far, as sorted (reason, count) pairs."""


@dataclass(frozen=True)
class Piece:
    """The part of one document placed in one sequence."""

    epoch: int
    """Epoch of the record."""
    record: int
    """Record index in the table."""
    parts: tuple[tuple[int, int, int], ...]
    """(segment, first token, end token) per placed segment; images use (segment, 0, 0)."""
    eod: bool
    """The document ends in this piece."""
    scale: int = 1
    """Length of the piece's sequence in ``seq_len`` units (``data.max_seq_len``)."""


@dataclass
class _Fill:
    room: int
    images: int
    gens: int
    pieces: list[Piece] = field(default_factory=list)
    clips: int = 0
    scale: int = 1
    """The sequence's length in ``seq_len`` units (its image and clip limits scale with it)."""


DocGetter = Callable[[int, int], "Document | Bad"]
"""(epoch, record) -> the parsed document (cached by the caller)."""
OrderGetter = Callable[[int], "list[int]"]
"""epoch -> record order."""


class Packer:
    """Greedy packing of the record stream into sequence plans, resumable from a ``Cursor``."""

    def __init__(self, ctx: ParseContext, n_records: int, get_doc: DocGetter, order: OrderGetter, where: str):
        self.ctx, self.n, self.get_doc, self.order, self.where = ctx, n_records, get_doc, order, where

    def _fits(self, fill: _Fill, seg, room_needed: int) -> bool:
        if room_needed > fill.room - 1:  # one slot always stays free for the closing eod
            return False
        cfg = self.ctx.cfg
        if isinstance(seg, ImageSeg):
            if seg.generate:
                return fill.gens < cfg.gen_images[1] * fill.scale
            return fill.images < cfg.max_images * fill.scale
        if isinstance(seg, AudioSeg):
            return fill.clips < cfg.max_audio * fill.scale
        return True

    def _lengthen(self, fill: _Fill, segs, seg_i: int, off: int) -> bool:
        """With ``max_seq_len``: whether what is left of a document (from segment ``seg_i``, token
        ``off``) closes the sequence being filled; an empty one grows to hold it instead."""
        cfg = self.ctx.cfg
        longest = longest_seq(cfg)
        if longest == cfg.seq_len:
            return False
        left = sum(seg_cost(s, self.ctx) for s in segs[seg_i:]) - off + 1  # + eod
        if left <= cfg.seq_len:
            return False
        if fill.pieces:
            return True
        fill.scale = min(-(-left // cfg.seq_len), longest // cfg.seq_len)
        fill.room = fill.scale * cfg.seq_len
        return False

    def _take(self, fill: _Fill, seg, cost: int) -> None:
        fill.room -= cost
        fill.clips += isinstance(seg, AudioSeg)
        if isinstance(seg, ImageSeg):
            fill.gens += seg.generate
            fill.images += not seg.generate

    def sequence(self, cur: Cursor) -> tuple[list[Piece], Cursor]:
        """Plan one sequence starting at ``cur``; returns its pieces and the cursor after it."""
        cfg = self.ctx.cfg
        fill = _Fill(cfg.seq_len, 0, 0)
        epoch, pos, seg_i, off = cur.epoch, cur.pos, cur.seg, cur.off
        skips = Counter(dict(cur.skips))
        bad_run = 0
        while True:
            if pos == self.n:
                epoch, pos = epoch + 1, 0
            record = self.order(epoch)[pos]
            doc = self.get_doc(epoch, record)
            if isinstance(doc, Bad):
                skips[doc.reason] += 1
                bad_run += 1
                if bad_run > self.n:
                    raise ConfigError(f"{self.where}: no usable records (skipped: {dict(skips)})")
                pos += 1
                continue
            bad_run = 0
            segs = doc.segments
            if not doc.splittable:
                total = sum(seg_cost(s, self.ctx) for s in segs)
                gens = sum(isinstance(s, ImageSeg) and s.generate for s in segs)
                inputs = sum(isinstance(s, ImageSeg) for s in segs) - gens
                clips = sum(isinstance(s, AudioSeg) for s in segs)
                ok = total <= fill.room - 1 and fill.images + inputs <= cfg.max_images
                ok = ok and fill.gens + gens <= cfg.gen_images[1] and fill.clips + clips <= cfg.max_audio
                if not ok:
                    break
                for s in segs:
                    self._take(fill, s, seg_cost(s, self.ctx))
                fill.room -= 1
                parts = tuple((i, 0, len(s.ids)) if isinstance(s, TextSeg) else (i, 0, 0) for i, s in enumerate(segs))
                fill.pieces.append(Piece(epoch, record, parts, eod=True, scale=fill.scale))
                pos += 1
                continue
            if self._lengthen(fill, segs, seg_i, off):
                break
            parts: list[tuple[int, int, int]] = []
            while seg_i < len(segs):
                s = segs[seg_i]
                if isinstance(s, TextSeg):
                    take = min(len(s.ids) - off, fill.room - 1)
                    if take <= 0:
                        break
                    parts.append((seg_i, off, off + take))
                    fill.room -= take
                    off += take
                    if off < len(s.ids):
                        break
                else:
                    cost = seg_cost(s, self.ctx)
                    if not self._fits(fill, s, cost):
                        break
                    self._take(fill, s, cost)
                    parts.append((seg_i, 0, 0))
                seg_i, off = seg_i + 1, 0
            done = seg_i == len(segs)
            if parts:
                fill.room -= done  # the eod slot kept free above
                fill.pieces.append(Piece(epoch, record, tuple(parts), eod=done, scale=fill.scale))
            if not done:
                break
            pos, seg_i, off = pos + 1, 0, 0
        if not fill.pieces:
            raise AssertionError(f"{self.where}: a validated document did not fit an empty sequence")
        return fill.pieces, Cursor(epoch, pos, seg_i, off, tuple(sorted(skips.items())))


def materialise(
    pieces: list[Piece],
    get_doc: DocGetter,
    ctx: ParseContext,
    special: SpecialTokens,
    sides: tuple[int, ...],
    sample_id: int,
    source: str,
    on_decode_error: Callable[[], None],
) -> PackedSample:
    """Tokens, labels and decoded pixels of one planned sequence; ``sides``: the side of each
    generator's targets (graph order)."""
    ids: list[int] = []
    images: list[torch.Tensor] = []
    targets: list[list[torch.Tensor]] = [[] for _ in sides]
    clips: list[torch.Tensor] = []
    doc_lens: list[int] = []
    p = ctx.patch_size
    for piece in pieces:
        doc = get_doc(piece.epoch, piece.record)
        assert isinstance(doc, Document)
        start = len(ids)
        for seg_i, lo, hi in piece.parts:
            s = doc.segments[seg_i]
            if isinstance(s, TextSeg):
                ids += s.ids[lo:hi]
                continue
            if isinstance(s, AudioSeg):
                clips.append(_clip(s, ctx, on_decode_error))
                ids += [special.boi] + [special.audio] * (s.frames // 2) + [special.eoi]
                continue
            size = (sides[s.gen],) * 2 if s.generate else (s.height, s.width)
            try:
                pixels = load_image(s.ref, *size, square_crop=s.generate)
            except (OSError, ValueError):
                # Passed the cheap plan-time check but fails to decode: grey keeps the plan valid.
                on_decode_error()
                pixels = torch.zeros(3, *size)
            if s.generate:
                ids += [special.boi] + [special.query(s.gen)] * ctx.queries(s.gen) + [special.eoi]
                targets[s.gen].append(pixels)
            else:
                ids += [special.boi] + [special.image] * ((s.height // p) * (s.width // p)) + [special.eoi]
                images.append(pixels)
        if piece.eod:
            ids.append(special.eod)
        doc_lens.append(len(ids) - start)
    length = pieces[0].scale * ctx.cfg.seq_len  # the planned length (module docstring)
    if len(ids) > length or length > longest_seq(ctx.cfg):
        raise AssertionError(f"packed {len(ids)} tokens into {length} (at most {longest_seq(ctx.cfg)})")
    ids += [special.pad] * (length - len(ids))
    t = torch.tensor(ids, dtype=torch.long)
    gen = [torch.stack(ts) if ts else torch.zeros(0, 3, r, r) for ts, r in zip(targets, sides)]
    meta = {"source": source, "records": [(int(pc.epoch), int(pc.record)) for pc in pieces]}
    return PackedSample(t, labels_for(t, special, doc_lens), images, gen, sample_id, tuple(doc_lens), meta, audio=clips)


def _clip(seg: AudioSeg, ctx: ParseContext, on_decode_error: Callable[[], None]) -> torch.Tensor:
    """The clip's log-mel features; silence-level features where it fails to decode (the plan,
    made from its header, stays valid)."""
    try:
        if seg.kind == "blob":
            clip = load_clip_bytes(blobs.read(seg.path), ctx.audio_mels, ctx.audio_max_frames, seg.path)
        else:
            clip = load_clip(seg.path, ctx.audio_mels, ctx.audio_max_frames)
    except (OSError, ValueError, EOFError):
        clip = None
    if clip is None or clip.shape[1] != seg.frames:
        on_decode_error()
        clip = torch.zeros(ctx.audio_mels, seg.frames)
    return clip

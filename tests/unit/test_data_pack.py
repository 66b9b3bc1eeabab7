"""Packing: documents into fixed-length sequences, split rules, limits and the paper-statistics source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.formats import Bad, Document, ImageSeg, ParseContext, TextSeg, parse_record
from disttrain_ds.data.images import ImageRef
from disttrain_ds.data.pack import Cursor, Packer, materialise
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.reader import RawRecord
from disttrain_ds.data.tokenizer import ByteTokenizer
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.samples import GenShape, ShapeSpec, SpecialTokens

SPECIAL = SpecialTokens.after(256)
PATCH, QUERY, GEN_RES = 8, 4, 16


def ctx_for(**kw) -> ParseContext:
    cfg = DataConfig(**{"seq_len": 32, "image_sizes": [16], "max_images": 3, "gen_images": [0, 1], **kw})
    return ParseContext(cfg, ByteTokenizer(), PATCH, (QUERY,), seed=0)


def text(n: int, start: int = 0) -> TextSeg:
    return TextSeg(tuple((start + i) % 200 for i in range(n)))


def image(generate: bool = False) -> ImageSeg:  # 16x16 px = 4 patches -> 6 tokens with markers
    return ImageSeg(ImageRef("photo", "http://example.com/a.jpg"), 16, 16, generate)


def pack(docs: list[Document | Bad], ctx: ParseContext, n_seq: int):
    packer = Packer(ctx, len(docs), lambda e, r: docs[r], lambda e: list(range(len(docs))), "test")
    cur, out = Cursor(), []
    for _ in range(n_seq):
        pieces, cur = packer.sequence(cur)
        out.append(materialise(pieces, lambda e, r: docs[r], ctx, SPECIAL, (GEN_RES,), len(out), "test", lambda: None))
    return out, cur


def text_ids(sample) -> list[int]:
    return [i for i in sample.input_ids.tolist() if i < 256]


def test_long_interleaved_document_continues_in_next_sequence_without_losing_tokens():
    ctx = ctx_for()
    doc = Document((text(20), image(), text(30, start=20), image(generate=True), text(5, start=50)), splittable=True)
    seqs, cur = pack([doc, doc], ctx, 3)  # 68 tokens with eod: three sequences of 31 usable slots
    for s in seqs:
        assert sample_problems(s, SPECIAL, PATCH, 32, (GenShape(GEN_RES, 3, QUERY),)) == []
    flat = [t for s in seqs for t in text_ids(s)]
    assert flat[:55] == [i % 200 for i in range(55)]  # every text token once, in order
    eods = [int((s.input_ids == SPECIAL.eod).sum()) for s in seqs]
    assert eods == [0, 0, 1]  # eod only after the document's last piece
    assert sum(len(s.images) for s in seqs) == 1 and sum(s.gen_targets[0].shape[0] for s in seqs) == 1
    assert seqs[2].doc_lens == (6, 20)  # the next document starts in the room left ...
    assert (cur.pos, cur.seg, cur.off) == (1, 1, 0)  # ... and continues at its image next time


def test_image_never_straddles_sequences():
    ctx = ctx_for()
    doc = Document((text(28), image(), text(3)), splittable=True)  # 28 + 6 > 31 usable slots
    seqs, _ = pack([doc], ctx, 2)
    assert (seqs[0].input_ids == SPECIAL.image).sum() == 0 and len(seqs[1].images) == 1


def test_caption_pair_that_does_not_fit_starts_the_next_sequence():
    ctx = ctx_for()
    pair = Document((image(), text(12)), splittable=False)  # 18 + eod = 19 tokens
    seqs, _ = pack([pair, pair], ctx, 2)
    assert seqs[0].doc_lens == (19,) and seqs[1].doc_lens == (19,)
    assert int((seqs[0].input_ids == SPECIAL.pad).sum()) == 32 - 19


def test_per_sequence_image_limits_close_the_sequence():
    ctx = ctx_for(seq_len=64, max_images=1, gen_images=[0, 1])
    pair, gen_pair = Document((image(), text(2)), False), Document((text(2), image(True)), False)
    seqs, _ = pack([pair, pair, gen_pair, gen_pair], ctx, 3)
    assert [len(s.images) for s in seqs] == [1, 1, 1]
    assert [int(s.gen_targets[0].shape[0]) for s in seqs] == [0, 1, 1]


def test_bad_documents_are_counted_in_the_cursor_and_skipped():
    ctx = ctx_for()
    seqs, cur = pack([Bad("empty_text"), Document((text(20),), False), Bad("empty_text")], ctx, 2)
    assert dict(cur.skips) == {"empty_text": 5}  # two epochs and the start of a third
    assert [text_ids(s) for s in seqs] == [list(range(20))] * 2


def test_all_bad_records_stop_with_a_message_naming_the_path():
    with pytest.raises(ValueError, match="test: no usable records"):
        pack([Bad("bad_json")], ctx_for(), 1)


def parse(obj: dict | bytes, fmt: str = "mmc4", **kw):
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_record(fmt, RawRecord(raw, Path("/tmp/x.jsonl"), 1), ctx_for(**kw), np.random.default_rng(0))


def test_mmc4_inputs_precede_their_sentence_and_the_last_image_is_generated_after_it():
    doc = parse({"text_list": ["One.", "Two.", "Three."], "image_info": [
        {"raw_url": "http://a/1.jpg", "matched_text_index": 2},
        {"raw_url": "http://a/0.jpg", "matched_text_index": 0},
    ]}, seq_len=128)
    kinds = ["gen" if isinstance(s, ImageSeg) and s.generate else "img" if isinstance(s, ImageSeg) else
             bytes(s.ids).decode() for s in doc.segments]
    assert kinds == ["img", "One.", " Two.", " Three.", "gen"]


@pytest.mark.parametrize("obj, reason", [
    ({"text_list": [], "image_info": []}, "empty_text"),
    ({"text_list": ["a"], "image_info": [{"raw_url": "u", "matched_text_index": 3}]}, "bad_type"),
    ({"text_list": "not a list"}, "bad_type"),
    ({"text_list": ["a"], "image_info": [{"raw_url": "", "matched_text_index": 0}]}, "bad_image"),
    (b'{"text_list": ["caf\xe9"]}', "not_utf8"),
    (b'{"text_list": [', "bad_json"),
    ({"text_list": ["\ud800 lone surrogate"]}, "not_utf8"),
])
def test_bad_mmc4_records_give_their_reason(obj, reason):
    assert parse(obj) == Bad(reason)


def test_image_larger_than_seq_len_is_a_bad_record():
    big = {"text_list": ["a"], "image_info": [{"raw_url": "u", "matched_text_index": 0}]}
    assert parse(big, seq_len=16, image_sizes=[32], gen_images=[0, 0]) == Bad("too_long")  # 16 patches


def test_paper_stats_sequences_fit_and_match_their_images():
    shape = ShapeSpec(patch_size=PATCH, gens=(GenShape(GEN_RES, 3, QUERY),))
    cfg = DataConfig(source="paper_stats", seq_len=1024, max_images=30, gen_images=[0, 4], gen_prob=0.3)
    src = build_source(cfg, shape, 4, seed=3)
    batches = [src.global_batch(step) for step in range(3)]
    for s in (s for b in batches for s in b):
        assert sample_problems(s, src.special, PATCH, 1024, (GenShape(GEN_RES, 3, QUERY),)) == []
    assert sum(len(s.images) for b in batches for s in b) > 0
    assert sum(int(s.gen_targets[0].shape[0]) for b in batches for s in b) > 0
    again = build_source(cfg, shape, 4, seed=3).global_batch(2)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again, batches[2]))


# --- sequences of their own length (data.max_seq_len) -------------------------------------------


def test_a_long_document_gets_a_sequence_of_its_own_and_short_ones_still_pack_to_seq_len():
    ctx = ctx_for(max_seq_len=128)
    short = Document((text(10),), splittable=True)
    long = Document((text(40), image(), text(30, start=40)), splittable=True)  # 77 tokens with eod
    seqs, _ = pack([short, long, short, short], ctx, 3)
    assert [int(s.input_ids.shape[0]) for s in seqs] == [32, 96, 32]
    assert seqs[0].doc_lens == (11,)  # the short document, then the sequence closes for the long one
    assert seqs[1].doc_lens[:2] == (77, 11)  # whole, then short ones fill the rest
    for s in seqs:
        assert sample_problems(s, SPECIAL, PATCH, 32, (GenShape(GEN_RES, 3, QUERY),), max_seq_len=128) == []
    flat = [t for s in seqs for t in text_ids(s)]
    assert flat[10:80] == [i % 200 for i in range(70)]  # the long document's text, once, in order
    with_short_limit = sample_problems(seqs[1], SPECIAL, PATCH, 32, (GenShape(GEN_RES, 3, QUERY),))
    assert with_short_limit and "up to" not in with_short_limit[0]  # without max_seq_len: refused


def test_a_document_beyond_max_seq_len_continues_in_the_next_long_sequence():
    ctx = ctx_for(max_seq_len=64)
    doc = Document((text(150),), splittable=True)  # 151 tokens with eod
    seqs, _ = pack([doc], ctx, 3)
    assert [int(s.input_ids.shape[0]) for s in seqs] == [64, 64, 32]
    assert [t for s in seqs for t in text_ids(s)][:150] == [i % 200 for i in range(150)]
    assert [s.doc_lens for s in seqs] == [(63,), (63,), (25,)]  # one eod slot kept free in each piece's sequence


def test_without_max_seq_len_packing_is_unchanged():
    docs = [Document((text(10),), splittable=True), Document((text(40), image(), text(30, start=40)), splittable=True)]
    plain, _ = pack(docs, ctx_for(), 4)
    same, _ = pack(docs, ctx_for(max_seq_len=32), 4)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(plain, same))
    assert {int(s.input_ids.shape[0]) for s in plain} == {32}


def test_a_long_sequence_holds_its_multiple_of_the_image_limit():
    ctx = ctx_for(max_seq_len=96, max_images=1)
    doc = Document((text(5), image(), text(5), image(), text(5), image(), text(5)), splittable=True)  # 39 with eod
    seqs, _ = pack([doc], ctx, 1)
    assert int(seqs[0].input_ids.shape[0]) == 64 and len(seqs[0].images) == 2  # 2 x 32 tokens: 2 images

"""Record input checks: byte-order marks are read, oversize images are refused before decoding."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageFile

from disttrain_ds.data.config import DataConfig, data_problem
from disttrain_ds.data.images import ImageDecodeError, ImageRef, check_file, load_image
from disttrain_ds.data.producers import build_source
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
BOM = b"\xef\xbb\xbf"
SIDE = 13000


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    """A valid, fully decodable 13000 x 13000 greyscale PNG of about 160 KiB (169 Mpixel once decoded).

    PIL alone only warns about it (under twice its MAX_IMAGE_PIXELS) and would decode it.
    """
    z, rows = zlib.compressobj(9), b"\0" * ((SIDE + 1) * 500)  # filter byte + pixels, 500 rows at a time
    idat = b"".join(z.compress(rows) for _ in range(SIDE // 500)) + z.flush()
    header = struct.pack(">IIBBBBB", SIDE, SIDE, 8, 0, 0, 0, 0)
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))
    return path


@pytest.fixture
def no_decode(monkeypatch):
    """Fail the test if any image of the bomb's size is decoded."""
    load = ImageFile.ImageFile.load

    def guarded(self):
        assert self.size != (SIDE, SIDE), "the oversize image was decoded"
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", guarded)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def source(tmp_path: Path, path: Path, fmt: str = "local", **kw):
    cfg = DataConfig(source=fmt, path=str(path), seq_len=64, image_sizes=[16], shuffle=False, gen_images=[0, 2],
                     cache_dir=str(tmp_path / "cache"), **kw)
    return build_source(cfg, SHAPE, 2, 0)


def test_a_record_line_starting_with_a_byte_order_mark_is_read(tmp_path):
    records = [{"caption": "a kite over the beach", "url": "https://e.com/1.jpg"},
               {"caption": "a dog on a sofa", "url": "https://e.com/2.jpg"}]
    plain = write_jsonl(tmp_path / "plain.jsonl", records)
    lines = [BOM + json.dumps(r).encode() for r in records] + [BOM, BOM + b"  "]
    marked = write_jsonl(tmp_path / "marked.jsonl", lines)
    want, got = source(tmp_path, plain, "laion"), source(tmp_path, marked, "laion")
    for a, b in zip(want.global_batch(0), got.global_batch(0), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and a.meta["records"] == b.meta["records"]
    assert got.skip_counts() == {}  # the marked lines are records, the mark-only lines blank


def test_a_13000_pixel_square_png_is_skipped_as_image_too_large_without_decoding(tmp_path, bomb, no_decode):
    with pytest.warns(Image.DecompressionBombWarning), Image.open(bomb) as img:  # PIL only warns
        assert img.size == (SIDE, SIDE) and SIDE * SIDE < 2 * Image.MAX_IMAGE_PIXELS
    Image.new("RGB", (20, 20), (200, 30, 30)).save(tmp_path / "ok.png")
    path = write_jsonl(tmp_path / "records.jsonl", [
        {"image": "ok.png", "caption": "a red square", "generate": False},
        {"image": str(bomb), "caption": "a huge grey square", "generate": False},
        {"segments": [{"text": "a document"}, {"image": str(bomb)}, {"text": "with a huge image"}]},
        {"image": "ok.png", "caption": "drawn", "generate": True},
    ])
    src = source(tmp_path, path)
    batch = src.global_batch(0)
    served = {r for s in batch for _, r in s.meta["records"]}
    assert 1 not in served and 2 not in served and {0, 3} <= served
    assert src.skip_counts()["image_too_large"] >= 2 and set(src.skip_counts()) == {"image_too_large"}
    assert check_file(str(bomb), DataConfig().max_image_pixels) == "image_too_large"


def test_max_image_pixels_sets_the_limit_and_is_checked_when_the_recipe_loads(tmp_path):
    Image.new("RGB", (25, 20), (10, 200, 10)).save(tmp_path / "g.png")  # 500 pixels
    path = write_jsonl(tmp_path / "r.jsonl", [{"image": "g.png", "caption": "green", "generate": False},
                                              {"segments": [{"text": "only words"}]}])
    fits, small = source(tmp_path, path, max_image_pixels=500), source(tmp_path, path, max_image_pixels=499)
    assert any(s.images for s in fits.global_batch(0)) and fits.skip_counts() == {}
    assert not any(s.images for s in small.global_batch(0))
    assert set(small.skip_counts()) == {"image_too_large"}  # once per epoch the step went through
    assert data_problem(DataConfig(max_image_pixels=0), 4) == ("max_image_pixels", "must be >= 1, got 0")
    assert DataConfig().max_image_pixels == 4096 * 4096


def test_an_image_that_grew_after_planning_is_refused_at_decode_time_too(bomb, no_decode):
    with pytest.raises(ImageDecodeError, match=rf"{SIDE} x {SIDE} pixels, more than {4096 * 4096}"):
        load_image(ImageRef("file", str(bomb), 4096 * 4096), 16, 16)

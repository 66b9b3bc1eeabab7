"""Fuzzing the record readers: corrupt local, Parquet, MMC4 and LAION records are counted, not fatal.

Every corrupt record (truncated, empty or oversize image, a missing file, non-UTF-8 text, malformed JSON,
wrong field types, oversize samples, ...) must be skipped and counted under its documented reason
in ``skip_counts()`` (docs/data.md, "Bad records"), while the valid records around it, images of
any PIL mode included, still come through as valid samples. A file with no usable record stops with
one line naming ``data.path``. No data file is changed by reading.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.images import ImageRef, load_image
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.errors import ConfigError
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
SEQ = 64
SEED = 20240811
REASONS = {"not_utf8", "bad_json", "bad_type", "bad_image", "missing_image", "corrupt_image", "image_too_large",
           "empty_text", "too_long", "unknown_generator"}


# ----------------------------------------------------------------------------- images


def _gradient(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    a = rng.uniform(0.2, 1.0, 3)
    arr = np.stack([(np.sin(3 * xx * a[c] + yy) * 0.5 + 0.5) * 255 for c in range(3)], -1)
    return Image.fromarray(arr.astype(np.uint8))


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, idat: bytes) -> bytes:
    """A PNG with a given header and pixel stream (valid chunk CRCs, ends with IEND)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def valid_images(rng: np.random.Generator) -> dict[str, bytes]:
    """Readable images in many modes and formats: all must be accepted (docs: any format PIL reads)."""
    base = _gradient(rng, 20, 28)
    grey16 = Image.fromarray((np.asarray(base.convert("L"), dtype=np.uint16) * 257))
    out = {
        "rgb.png": _encode(base, "PNG"),
        "rgb.jpg": _encode(base, "JPEG"),
        "cmyk.jpg": _encode(base.convert("CMYK"), "JPEG"),
        "cmyk.tif": _encode(base.convert("CMYK"), "TIFF"),
        "palette.png": _encode(base.convert("P"), "PNG"),
        "palette.gif": _encode(base, "GIF"),
        "bilevel.png": _encode(base.convert("1"), "PNG"),
        "rgba.png": _encode(base.convert("RGBA"), "PNG"),
        "la.png": _encode(base.convert("LA"), "PNG"),
        "grey.png": _encode(base.convert("L"), "PNG"),
        "grey16.png": _encode(grey16, "PNG"),
        "rgb.bmp": _encode(base, "BMP"),
        "one_pixel.png": _encode(base.resize((1, 1)), "PNG"),
        "sliver.png": _encode(base.resize((300, 2)), "PNG"),
    }
    if features.check("webp"):
        out["rgb.webp"] = _encode(base, "WEBP")
    return out


def corrupt_images(rng: np.random.Generator, py: random.Random) -> dict[str, bytes]:
    """Unreadable image files, all ``corrupt_image``."""
    png, jpg = _encode(_gradient(rng, 24, 24), "PNG"), _encode(_gradient(rng, 24, 24), "JPEG")
    out = {}
    for i in range(12):  # cut anywhere before the end marker (the IEND chunk is the last 12 bytes)
        out[f"cut{i}.png"] = png[: py.randrange(0, len(png) - 12)]
        out[f"cut{i}.jpg"] = jpg[: py.randrange(0, len(jpg) - 2)]
    out.update({
        "empty.png": b"",
        "empty.jpg": b"",
        "zero_by_zero.png": _png(0, 0, zlib.compress(b"")),
        "text.png": b"this is not an image\n",
        "noise.jpg": bytes(rng.integers(0, 256, 300, dtype=np.uint8)),
        "header_only.png": png[:33],
    })
    return out


def oversize_images() -> dict[str, bytes]:
    """Headers over ``data.max_image_pixels`` (and over PIL's own limit): ``image_too_large``, never decoded."""
    return {
        "bomb.png": _png(30000, 30000, zlib.compress(b"\0" * 64)),  # 900 Mpixel header, over PIL's limit too
        "wide.png": _png(70000, 300, zlib.compress(b"\0" * 64)),  # 21 Mpixel: over the 16.8 Mpixel default
    }


def undecodable_images(rng: np.random.Generator) -> dict[str, bytes]:
    """Files whose header and end marker are intact but whose pixels do not decode."""
    return {
        "garbled_pixels.png": _png(8, 8, bytes(rng.integers(0, 256, 60, dtype=np.uint8))),
        "short_pixels.png": _png(8, 8, zlib.compress(b"\0" * 10)),
    }


# ----------------------------------------------------------------------------- record files


@dataclass
class Corpus:
    """Record lines with the reason each must be skipped for (None: a valid record)."""

    lines: list[bytes] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    decode_fails: set[int] = field(default_factory=set)
    """Valid records whose (one) image fails to decode: served with a grey image and counted."""

    def add(self, record: object, reason: str | None = None) -> None:
        raw = record if isinstance(record, bytes) else json.dumps(record).encode()
        assert b"\n" not in raw and raw.strip(), raw
        self.lines.append(raw)
        self.reasons.append(reason)

    def write(self, path: Path) -> Path:
        path.write_bytes(b"".join(line + b"\n" for line in self.lines))
        return path

    @property
    def valid(self) -> set[int]:
        return {i for i, r in enumerate(self.reasons) if r is None}

    def corrupt_count(self) -> int:
        return sum(r is not None for r in self.reasons)

    def shuffled(self, py: random.Random) -> "Corpus":
        """The same records in a random order that starts and ends with a valid one."""
        order = list(range(len(self.lines)))
        py.shuffle(order)
        valid = [i for i in order if self.reasons[i] is None]
        order.remove(valid[0])
        order.remove(valid[1])
        order = [valid[0], *order, valid[1]]
        out = Corpus([self.lines[i] for i in order], [self.reasons[i] for i in order])
        out.decode_fails = {k for k, i in enumerate(order) if i in self.decode_fails}
        return out


def text(py: random.Random, lo: int = 3, hi: int = 25) -> str:
    words = "red kite beach night dog sofa blue square river city light tree".split()
    out = " ".join(py.choice(words) for _ in range(12))
    return out[: py.randint(lo, hi)].strip() or "kite"


def bad_text_lines(make) -> list[tuple[bytes, str | None]]:
    """Lines that fail before their fields are read (encoding, JSON syntax, top-level type), and one that does not."""
    return [
        (make("caf\xe9").encode("latin-1"), "not_utf8"),
        (b"\xff" + make("x").encode(), "not_utf8"),
        (make("ok").encode().replace(b"ok", b"\xc0\xaf"), "not_utf8"),  # overlong encoding
        (make("ok").encode().replace(b"ok", b"\xe2\x82"), "not_utf8"),  # cut multi-byte character
        (make("caf\xe9").encode("utf-16-le"), "not_utf8"),
        (make("kite").encode("utf-16-le"), "bad_json"),  # ASCII in UTF-16 is valid UTF-8 with NUL bytes
        (make("ok").encode().replace(b"ok", b"\\ud800 kite"), "not_utf8"),  # lone surrogate escape
        (make("ok").encode()[:-3], "bad_json"),  # truncated
        (b"{" + make("ok").encode()[1:-1] + b",}", "bad_json"),  # trailing comma
        (make("ok").encode().replace(b'"', b"'"), "bad_json"),
        (b"\xef\xbb\xbf" + make("ok").encode(), None),  # a UTF-8 byte-order mark: dropped, the record is read
        (b"\xef\xbb\xbf" + make("ok").encode()[:-3], "bad_json"),  # ... but it does not mend what follows
        (b"not json at all", "bad_json"),
        (b"{", "bad_json"),
        (b'{"caption": "a' + b"\x01" + b'"}', "bad_json"),  # raw control character
        (b"[" * 100000 + b"]" * 100000, "bad_json"),  # nested deeper than the parser goes
        (b'{"caption": ' + b"9" * 5000 + b"}", "bad_json"),  # an integer too long to convert
        (b'["a", "list"]', "bad_type"),
        (b'"a string"', "bad_type"),
        (b"42", "bad_type"),
        (b"null", "bad_type"),
        (b"true", "bad_type"),
        (b"{}", "bad_type"),
    ]


def local_corpus(root: Path, py: random.Random, rng: np.random.Generator) -> Corpus:
    """Local pairs and documents: ~40 valid, ~120 corrupt, images written under ``root/images``."""
    images = root / "images"
    images.mkdir(parents=True)
    good, corrupt, undecodable = valid_images(rng), corrupt_images(rng, py), undecodable_images(rng)
    oversize = oversize_images()
    for name, blob in {**good, **corrupt, **undecodable, **oversize}.items():
        (images / name).write_bytes(blob)
    (images / "folder.png").mkdir()
    os.symlink(images / "gone.png", images / "dangling.png")
    os.symlink(images / "loop_b.png", images / "loop_a.png")
    os.symlink(images / "loop_a.png", images / "loop_b.png")
    c = Corpus()
    for name in good:  # every mode as a pair, both ways round, and inside a document
        c.add({"image": f"images/{name}", "caption": text(py), "generate": False})
        c.add({"image": f"images/{name}", "caption": text(py), "generate": True})
        c.add({"segments": [{"text": text(py)}, {"image": f"images/{name}"}, {"text": text(py)}]})
    c.add({"image": str(images / "rgb.png"), "caption": text(py)})  # absolute path
    long_doc = [{"text": text(py, 200, 400)}] + [{"image": f"images/{n}"} for n in list(good)[:8]]
    c.add({"segments": long_doc})  # spans several sequences
    for name in undecodable:
        c.decode_fails.add(len(c.lines))
        c.add({"image": f"images/{name}", "caption": text(py), "generate": False})

    for name in corrupt:
        c.add({"image": f"images/{name}", "caption": text(py)}, "corrupt_image")
        if py.random() < 0.3:
            c.add({"segments": [{"text": text(py)}, {"image": f"images/{name}"}]}, "corrupt_image")
    for name in oversize:
        c.add({"image": f"images/{name}", "caption": text(py)}, "image_too_large")
        c.add({"segments": [{"text": text(py)}, {"image": f"images/{name}"}]}, "image_too_large")
    for ref in ["images/nope.png", str(root / "elsewhere" / "x.jpg"), "images/folder.png", "images/dangling.png",
                "../../../../no/such/file.png", "images/rgb.png/inside.png", "images/" + "x" * 300 + ".png"]:
        c.add({"image": ref, "caption": text(py)}, "missing_image")
    c.add({"segments": [{"text": text(py)}, {"image": "images/rgb.png"}, {"image": "images/nope.jpg"}]}, "missing_image")
    for ref in ["", "   ", 5, None, ["images/rgb.png"], {"path": "images/rgb.png"}, True, "images/a\u0000b.png",
                "images/\ud800.png", "images/loop_a.png"]:
        c.add({"image": ref, "caption": text(py)}, "bad_image")
    c.add({"segments": [{"text": text(py)}, {"image": 7}]}, "bad_image")

    for line, reason in bad_text_lines(lambda s: json.dumps({"image": "images/rgb.png", "caption": s}, ensure_ascii=False)):
        c.add(line, reason)
    c.add({"segments": [{"text": "ok \ud800"}, {"image": "images/rgb.png"}]}, "not_utf8")
    for caption in [5, 2.5, ["a"], {"t": "a"}, True, None, float("nan")]:
        c.add({"image": "images/rgb.png", "caption": caption}, "bad_type")
    for gen in [1, [True], 0]:
        c.add({"image": "images/rgb.png", "caption": text(py), "generate": gen}, "bad_type")
    for gen in ["yes", "true", ""]:  # a string names a generator: this model has none by these names
        c.add({"image": "images/rgb.png", "caption": text(py), "generate": gen}, "unknown_generator")
    c.add({"segments": [{"text": "x"}, {"image": "images/rgb.png", "generate": "no"}]}, "unknown_generator")
    for record in [
        {"caption": "no image"}, {"image": "images/rgb.png"}, {"segments": {"text": "x"}}, {"segments": "x"},
        {"segments": 5}, {"segments": None}, {"segments": ["text"]}, {"segments": [5]}, {"segments": [[{"text": "x"}]]},
        {"segments": [{"text": "x", "image": "images/rgb.png"}]}, {"segments": [{"caption": "x"}]},
        {"segments": [{"text": 5}]}, {"segments": [{"text": ["x"]}]},
        {"segments": [{"text": "x"}, {"image": "images/rgb.png", "generate": 1}]},
    ]:
        c.add(record, "bad_type")
    for record in [
        {"image": "images/rgb.png", "caption": ""}, {"image": "images/rgb.png", "caption": "   "},
        {"image": "images/rgb.png", "caption": "\n\t "}, {"segments": []}, {"segments": [{"image": "images/rgb.png"}]},
        {"segments": [{"text": "  "}, {"image": "images/rgb.png"}, {"text": ""}]},
    ]:
        c.add(record, "empty_text")
    for n in (58, 70, 200, 5000):  # a caption pair must fit one sequence: 4 patches + markers + eod
        c.add({"image": "images/rgb.png", "caption": "k" * n, "generate": False}, "too_long")
    c.add({"image": "images/rgb.png", "caption": "k" * 58, "generate": True}, "too_long")  # 4 queries + markers
    return c.shuffled(py)


def caption_corpus(py: random.Random) -> Corpus:
    """LAION caption pairs (``caption``, optional ``url``)."""
    c = Corpus()
    for i in range(15):
        record = {"caption": text(py)}
        if i % 3:
            record["url"] = f"https://example.com/img/{i}.jpg"
        c.add(record)
    url = "https://example.com/x.jpg"
    for line, reason in bad_text_lines(lambda s: json.dumps({"caption": s, "url": url}, ensure_ascii=False)):
        c.add(line, reason)
    for cap in [5, None, ["a"], {"a": 1}, False]:
        c.add({"caption": cap, "url": "https://example.com/y.jpg"}, "bad_type")
    c.add({"url": "https://example.com/no_caption.jpg"}, "bad_type")
    for url in ["", "  ", 5, ["https://example.com/z.jpg"], {"u": 1}, False]:
        c.add({"caption": text(py), "url": url}, "bad_image")
    for cap in ["", "    ", "\n"]:
        c.add({"caption": cap}, "empty_text")
    for n in (58, 300, 4000):
        c.add({"caption": "w" * n}, "too_long")
    return c.shuffled(py)


def mmc4_corpus(py: random.Random) -> Corpus:
    """MMC4 documents (``text_list`` sentences, ``image_info`` with ``raw_url`` and ``matched_text_index``)."""
    c = Corpus()
    for i in range(12):
        sentences = [text(py) for _ in range(py.randint(1, 5))]
        infos = [{"raw_url": f"https://example.com/{i}/{k}.jpg", "matched_text_index": py.randrange(len(sentences))}
                 for k in range(py.randint(0, 3))]
        c.add({"text_list": sentences, "image_info": infos})
    long_info = [{"raw_url": "https://e.com/l.jpg", "matched_text_index": 1}]
    c.add({"text_list": [text(py, 300, 500)] * 3, "image_info": long_info})  # spans several sequences
    info = {"raw_url": "https://example.com/a.jpg", "matched_text_index": 0}
    for line, reason in bad_text_lines(lambda s: json.dumps({"text_list": [s], "image_info": [info]}, ensure_ascii=False)):
        c.add(line, reason)
    for text_list in ["one sentence", {"0": "x"}, None, 5]:
        c.add({"text_list": text_list, "image_info": [info]}, "bad_type")
    c.add({"image_info": [info]}, "bad_type")  # no text_list at all
    for infos in ["x", {"raw_url": "u"}, 5, ["x"], [None], [[info]]]:
        c.add({"text_list": ["a sentence"], "image_info": infos}, "bad_type")
    for index in ["0", True, -1, 1, 99, 0.0, None]:
        c.add({"text_list": ["a sentence"], "image_info": [{"raw_url": "https://e.com/i.jpg", "matched_text_index": index}]},
              "bad_type")
    c.add({"text_list": ["a sentence"], "image_info": [{"raw_url": "https://e.com/i.jpg"}]}, "bad_type")
    c.add({"text_list": ["ok", 5], "image_info": []}, "bad_type")
    for url in ["", "  ", 7, None, ["https://e.com/x.jpg"]]:
        c.add({"text_list": ["a sentence"], "image_info": [{"raw_url": url, "matched_text_index": 0}]}, "bad_image")
    for sentences in [[], ["", "  "], ["\t"]]:
        c.add({"text_list": sentences, "image_info": []}, "empty_text")
    c.add({"text_list": [], "image_info": []}, "empty_text")
    return c.shuffled(py)


# ----------------------------------------------------------------------------- running a source


def snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def open_source(fmt: str, path: Path, cache: Path, **kw):
    cfg = DataConfig(source=fmt, path=str(path), seq_len=SEQ, image_sizes=[16], shuffle=False, gen_images=[0, 2],
                     cache_dir=str(cache), **kw)
    return build_source(cfg, SHAPE, 4, SEED)


def drain(src, corpus: Corpus, max_steps: int = 200) -> Counter:
    """Serve steps until every valid record has come through; returns how often each record was served."""
    served: Counter = Counter()
    for step in range(max_steps):
        for s in src.global_batch(step):
            assert sample_problems(s, src.special, SHAPE.patch_size, SEQ, SHAPE.gens) == []
            for epoch, record in s.meta["records"]:
                served[epoch, record] += 1
        if corpus.valid <= {r for _, r in served}:
            return served
    raise AssertionError(f"valid records never served: {sorted(corpus.valid - {r for _, r in served})}")


def expected_skips(src, corpus: Corpus) -> Counter:
    """Reasons of every corrupt record the source has passed (file order: shuffle is off)."""
    cur = src.state_dict()["inner"]["cursor"]  # where planning stopped (the next step's start)
    per_epoch = Counter(r for r in corpus.reasons if r)
    out = Counter({k: v * cur["epoch"] for k, v in per_epoch.items()})
    out.update(r for r in corpus.reasons[: cur["pos"]] if r)
    return out


def check_source(src, corpus: Corpus) -> None:
    served = drain(src, corpus)
    assert {r for _, r in served} == corpus.valid, "a corrupt record was served"
    expect = expected_skips(src, corpus)
    fails = sum(n for (_, r), n in served.items() if r in corpus.decode_fails)
    if fails:
        expect["image_decode_failed"] = fails
    assert src.skip_counts() == dict(sorted(expect.items()))


# ----------------------------------------------------------------------------- tests


def test_corrupt_local_records_are_counted_by_reason_and_valid_ones_still_train(tmp_path):
    py, rng = random.Random(SEED), np.random.default_rng(SEED)
    data = tmp_path / "data"
    corpus = local_corpus(data, py, rng)
    assert corpus.corrupt_count() >= 100 and {r for r in corpus.reasons if r} == REASONS
    path = corpus.write(data / "records.jsonl")
    before = snapshot(data)
    with open_source("local", path, tmp_path / "cache") as src:
        check_source(src, corpus)
    assert snapshot(data) == before


def test_corrupt_local_parquet_rows_are_counted_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    py, rng = random.Random(SEED + 1), np.random.default_rng(SEED + 1)
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    for name, blob in {**valid_images(rng), **corrupt_images(rng, py), **oversize_images()}.items():
        (data / "images" / name).write_bytes(blob)
    rows = [("images/rgb.png", text(py), None, None), ("images/cmyk.jpg", text(py), False, None),
            ("images/grey16.png", text(py), True, None), ("images/palette.gif", text(py), None, None),
            ("images/nope.png", text(py), None, "missing_image"), ("images/cut3.png", text(py), None, "corrupt_image"),
            ("images/empty.jpg", text(py), None, "corrupt_image"), ("images/bomb.png", text(py), None, "image_too_large"),
            ("images/rgb.png", None, None, "bad_type"), ("images/rgb.png", "", None, "empty_text"),
            ("images/rgb.png", "k" * 80, False, "too_long"), ("", text(py), None, "bad_image"),
            (None, text(py), None, "bad_image"), ("images/la.png", text(py), None, None)]
    table = pa.table({"image": [r[0] for r in rows], "caption": [r[1] for r in rows],
                      "generate": pa.array([r[2] for r in rows], pa.bool_())})
    pq.write_table(table, data / "pairs.parquet")
    corpus = Corpus()
    for row in rows:
        corpus.add({"row": 1}, row[3])  # lines are not written: the reasons and the valid rows are what count
    before = snapshot(data)
    with open_source("local", data, tmp_path / "cache") as src:
        check_source(src, corpus)
    assert snapshot(data) == before


@pytest.mark.parametrize("fmt", ["laion", "mmc4"])
def test_corrupt_web_metadata_records_are_counted_by_reason(fmt, tmp_path):
    py = random.Random(SEED + 2)
    corpus = caption_corpus(py) if fmt == "laion" else mmc4_corpus(py)
    assert corpus.corrupt_count() >= 40
    path = corpus.write(tmp_path / f"{fmt}.jsonl")
    before = snapshot(tmp_path)
    with open_source(fmt, path, tmp_path.parent / f"{tmp_path.name}_cache") as src:
        check_source(src, corpus)
    assert snapshot(tmp_path) == before


def test_samples_over_the_image_limits_are_counted_as_too_long_or_too_many(tmp_path):
    rng = np.random.default_rng(SEED + 3)
    (tmp_path / "rgb.png").write_bytes(_encode(_gradient(rng, 40, 40), "PNG"))
    c = Corpus()
    c.add({"image": "rgb.png", "caption": "drawn, not read", "generate": True})  # generation needs no input slot
    c.add({"segments": [{"text": "only words"}]})
    c.add({"image": "rgb.png", "caption": "read as input", "generate": False}, "too_many_images")
    c.add({"segments": [{"text": "a photo"}, {"image": "rgb.png", "generate": False}, {"text": "and words"}]},
          "too_many_images")
    c.add({"segments": [{"text": "words"}, {"image": "rgb.png"}, {"image": "rgb.png"}, {"text": "end"}]}, "too_many_images")
    c.add({"segments": [{"text": "more words"}]})
    path = c.write(tmp_path / "records.jsonl")
    with open_source("local", path, tmp_path / "cache", max_images=0) as src:  # no input images at all
        check_source(src, c)
    big = Corpus()  # one 64x64 input image is 64 placeholders + 2 markers: more than seq_len on its own
    big.add({"image": "rgb.png", "caption": "drawn", "generate": True})
    big.add({"image": "rgb.png", "caption": "read", "generate": False}, "too_long")
    big.add({"segments": [{"text": "doc"}, {"image": "rgb.png", "generate": False}, {"text": "end"}]}, "too_long")
    big.add({"segments": [{"text": "words only"}]})
    path = big.write(tmp_path / "big.jsonl")
    cfg = DataConfig(source="local", path=str(path), seq_len=SEQ, image_sizes=[64], shuffle=False, gen_images=[0, 2],
                     cache_dir=str(tmp_path / "cache"))
    with build_source(cfg, SHAPE, 4, SEED) as src:
        check_source(src, big)


@pytest.mark.parametrize("fmt", ["local", "laion", "mmc4"])
def test_a_file_of_only_corrupt_records_stops_with_one_line_naming_data_path(fmt, tmp_path):
    lines = [b"\xff\xfe", b"{not json", b"[1, 2]", json.dumps({"caption": 5, "text_list": 5}).encode()]
    path = tmp_path / f"{fmt}.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    before = snapshot(tmp_path)
    with open_source(fmt, path, tmp_path.parent / f"{tmp_path.name}_cache") as src:
        with pytest.raises(ConfigError) as err:
            src.global_batch(0)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("data.path") and str(path) in msg and "no usable records" in msg
    assert snapshot(tmp_path) == before


def test_16_bit_greyscale_is_scaled_to_8_bits_not_clipped_to_white(tmp_path):
    path = tmp_path / "grey16.png"
    Image.fromarray(np.full((8, 8), 0x4000, dtype=np.uint16)).save(path)  # a quarter of full scale
    assert Image.open(path).mode.startswith("I;16")
    pixels = load_image(ImageRef("file", str(path)), 8, 8)
    assert abs(pixels.mean().item() - (0x40 / 127.5 - 1)) < 0.02  # clipped, it would be 1.0


@pytest.mark.slow
def test_training_on_a_file_of_only_corrupt_records_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\xfe\n{not json\n[1]\n")
    before = snapshot(tmp_path)
    cmd = [sys.executable, str(repo / "tools" / "train.py"), "--recipe", str(repo / "recipes" / "tiny_cpu.yaml"),
           "data.source=local", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1",
           f"logging.dir={tmp_path / 'run'}", "logging.wandb=disabled"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert "data.path" in lines[0] and str(path) in lines[0] and "no usable records" in lines[0]
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # new files only (run dir, cache)

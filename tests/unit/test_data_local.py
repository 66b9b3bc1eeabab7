"""Local records with real image files, and bad records counted instead of raised."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
RED, BLUE = (255, 0, 0), (0, 0, 255)


def solid(path: Path, rgb, fmt: str = "PNG") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), rgb).save(path, format=fmt)
    return path.name if path.parent.name == "images" else str(path)


def write_jsonl(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            f.write(b"\n")
    return path


def colour(im) -> np.ndarray:
    return im.mean(dim=(1, 2)).numpy()


def local_source(path: Path, **kw):
    cfg = DataConfig(**{"source": "local", "path": str(path), "seq_len": 64, "image_sizes": [16], "shuffle": False,
                        "gen_images": [0, 2], **kw})
    return build_source(cfg, SHAPE, 2, 0)


def test_local_folder_reads_real_image_files_and_honours_generate_marks(tmp_path):
    solid(tmp_path / "images" / "red.png", RED)
    solid(tmp_path / "images" / "blue.jpg", BLUE, "JPEG")
    write_jsonl(tmp_path / "a_docs.jsonl", [
        {"segments": [{"text": "A red square."}, {"image": "images/red.png"}, {"text": "Now draw blue:"},
                      {"image": "images/blue.jpg", "generate": True}]},
    ])
    write_jsonl(tmp_path / "b_pairs.jsonl", [{"image": "images/blue.jpg", "caption": "Blue.", "generate": False}])
    src = local_source(tmp_path)
    batch = src.global_batch(0)
    for s in batch:
        assert sample_problems(s, src.special, 8, 64, (GenShape(16, 3, 4),)) == []
    first = batch[0]  # the document (41 tokens with eod), then the pair (12), then the document again
    assert first.doc_lens[:2] == (41, 12) and first.meta["records"][:2] == [(0, 0), (0, 1)]
    assert np.allclose(colour(first.images[0]), [1, -1, -1], atol=0.05)  # the document reads red.png
    assert first.gen_targets[0].shape[0] == 1  # and generates blue.jpg (marked), at the generator's size
    assert np.allclose(colour(first.gen_targets[0][0]), [-1, -1, 1], atol=0.05)
    assert np.allclose(colour(first.images[1]), [-1, -1, 1], atol=0.05)  # the pair reads blue.jpg
    assert src.skip_counts() == {}


def test_bad_records_are_skipped_and_counted_by_reason(tmp_path):
    good = solid(tmp_path / "ok.png", RED)
    truncated = tmp_path / "truncated.jpg"
    solid(truncated, BLUE, "JPEG")
    truncated.write_bytes(truncated.read_bytes()[:200])
    (tmp_path / "not_an_image.png").write_bytes(b"hello")
    path = write_jsonl(tmp_path / "records.jsonl", [
        {"image": good, "caption": "fine"},
        {"image": str(tmp_path / "missing.png"), "caption": "no file"},
        {"image": str(truncated), "caption": "cut short"},
        {"image": str(tmp_path / "not_an_image.png"), "caption": "text file"},
        {"image": good, "caption": "   "},
        {"image": good, "caption": "x" * 200},  # longer than seq_len with the byte tokenizer
        b'{"image": "ok.png", "caption": "caf\xe9 in latin-1"}',
        {"image": good, "caption": 5},
        {"image": 3, "caption": "image is a number"},
        b'{"image": "ok.png", "caption": ',
        ["not", "an", "object"],
    ])
    src = local_source(path)
    for step in range(3):
        for s in src.global_batch(step):
            assert sample_problems(s, src.special, 8, 64, (GenShape(16, 3, 4),)) == []
            assert s.meta["records"] and all(r == 0 for _, r in s.meta["records"])  # only the good record
    counts = src.skip_counts()
    per_epoch = {"missing_image": 1, "corrupt_image": 2, "empty_text": 1, "too_long": 1, "not_utf8": 1,
                 "bad_type": 2, "bad_image": 1, "bad_json": 1}
    epochs = counts["bad_json"]
    assert counts == {k: v * epochs for k, v in per_epoch.items()}


def test_a_file_with_no_usable_record_fails_with_one_line_naming_data_path(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"caption": "no image"}, b"\xff\xfe"])
    src = local_source(path)
    with pytest.raises(ValueError) as err:
        src.global_batch(0)
    assert str(err.value).startswith("data.path") and "no usable records" in str(err.value) and "\n" not in str(err.value)


def test_parquet_records_are_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    img = solid(tmp_path / "red.png", RED)
    pq.write_table(pa.table({"image": [img, img], "caption": ["one", "two"]}), tmp_path / "a_pairs.parquet")
    segments = [[{"text": "Red:", "image": None}, {"text": None, "image": img}]]
    pq.write_table(pa.table({"segments": segments}), tmp_path / "b_docs.parquet")
    src = local_source(tmp_path, gen_prob=0.0, gen_images=[0, 0])
    batch = src.global_batch(0)
    assert src.skip_counts() == {}
    records = {r for s in batch for r in s.meta["records"]}
    assert {(0, 0), (0, 1), (0, 2)} <= records  # both pairs and the document
    assert all(np.allclose(colour(im), [1, -1, -1], atol=0.05) for s in batch for im in s.images)

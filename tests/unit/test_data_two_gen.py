"""Records naming the generator of each target (``generate``: true or a generator's name), for a model
with two generators: local pairs and documents, webdataset and parquet pairs and documents; unknown
names skipped by reason; the recipe check accepts these sources."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.registry import open_source
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.samples import GenShape, ShapeSpec

# The painter: 16 x 16 targets, 4 queries; the sketcher: 8 x 8 targets, 2 queries.
SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4, "painter"), GenShape(8, 3, 2, "sketcher")))
RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 255, 0)


def jpeg(rgb) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), rgb).save(buf, format="JPEG")
    return buf.getvalue()


def solid(path: Path, rgb) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), rgb).save(path, format="PNG")


def write_jsonl(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "default-cache"))


def _cfg(source: str, path, **kw) -> DataConfig:
    return DataConfig(**{"source": source, "path": str(path), "seq_len": 64, "image_sizes": [16], "shuffle": False,
                         "gen_images": [0, 2], **kw})


def colour(im) -> np.ndarray:
    return im.mean(dim=(1, 2)).numpy()


def _ok(src, s) -> None:
    assert sample_problems(s, src.special, 8, 64, SHAPE.gens) == []


def _runs(ids: torch.Tensor, token: int) -> int:
    mask = ids == token
    return int((mask & ~torch.cat([torch.tensor([False]), mask[:-1]])).sum())


def _pairs(tmp_path: Path, marks: list) -> Path:
    for name, rgb in (("red", RED), ("blue", BLUE), ("green", GREEN)):
        solid(tmp_path / "images" / f"{name}.png", rgb)
    lines = [{"image": f"images/{n}.png", "caption": f"A {n} square.", "generate": m}
             for n, m in zip(("red", "blue", "green"), marks)]
    return write_jsonl(tmp_path / "pairs.jsonl", lines)


def test_local_pairs_name_their_generator_and_each_gets_its_own_query_token_and_size(tmp_path):
    src = build_source(_cfg("local", _pairs(tmp_path, ["sketcher", "painter", True])), SHAPE, 1, 0)
    assert src.special.queries == (src.special.gen, src.special.query(1)) and src.special.query(1) != src.special.gen
    s = src.global_batch(0)[0]  # red (sketcher) + blue (painter); green (the first generator) no longer fits
    _ok(src, s)
    assert s.gen_targets[0].shape == (1, 3, 16, 16) and s.gen_targets[1].shape == (1, 3, 8, 8)
    assert np.allclose(colour(s.gen_targets[1][0]), [1, -1, -1], atol=0.05)  # red, at the sketcher's 8 x 8
    assert np.allclose(colour(s.gen_targets[0][0]), [-1, -1, 1], atol=0.05)
    assert _runs(s.input_ids, src.special.query(1)) == 1 and int((s.input_ids == src.special.query(1)).sum()) == 2
    assert s.doc_lens[0] == len("A red square.") + 2 + 2 + 1  # priced by the sketcher's own 2 queries
    s = src.global_batch(1)[0]
    assert np.allclose(colour(s.gen_targets[0][0]), [-1, 1, -1], atol=0.05)  # true: the first generator


def test_swapping_the_names_swaps_which_generator_gets_each_target(tmp_path):
    a = build_source(_cfg("local", _pairs(tmp_path / "a", ["sketcher", "painter", False])), SHAPE, 1, 0).global_batch(0)[0]
    b = build_source(_cfg("local", _pairs(tmp_path / "b", ["painter", "sketcher", False])), SHAPE, 1, 0).global_batch(0)[0]
    assert np.allclose(colour(a.gen_targets[1][0]), [1, -1, -1], atol=0.05)
    assert np.allclose(colour(b.gen_targets[1][0]), [-1, -1, 1], atol=0.05)
    assert np.allclose(colour(b.gen_targets[0][0]), [1, -1, -1], atol=0.05)


def test_local_documents_mark_images_for_either_generator(tmp_path):
    solid(tmp_path / "images" / "red.png", RED)
    solid(tmp_path / "images" / "blue.png", BLUE)
    write_jsonl(tmp_path / "docs.jsonl", [{"segments": [
        {"text": "Sketch red:"}, {"image": "images/red.png", "generate": "sketcher"},
        {"text": "paint blue:"}, {"image": "images/blue.png", "generate": True}]}])
    src = build_source(_cfg("local", tmp_path, seq_len=128), SHAPE, 1, 0)
    s = src.global_batch(0)[0]
    assert sample_problems(s, src.special, 8, 128, SHAPE.gens) == []
    assert np.allclose(colour(s.gen_targets[1][0]), [1, -1, -1], atol=0.05)
    assert np.allclose(colour(s.gen_targets[0][0]), [-1, -1, 1], atol=0.05) and not s.images
    ids = s.input_ids.tolist()
    assert ids.index(src.special.query(1)) < ids.index(src.special.gen)  # in the document's order


def test_an_unknown_generator_name_skips_the_record_by_reason(tmp_path):
    src = build_source(_cfg("local", _pairs(tmp_path, ["painter", "sketch", "sketcher"])), SHAPE, 1, 0)
    s = src.global_batch(0)[0]  # red for the painter, blue skipped, green for the sketcher
    assert s.gen_targets[0].shape[0] == 1 and s.gen_targets[1].shape[0] == 1
    assert src.skip_counts() == {"unknown_generator": 1}
    write_jsonl(tmp_path / "pairs.jsonl", [{"image": "images/red.png", "caption": "red", "generate": "painterr"}])
    with pytest.raises(ConfigError, match="no usable records.*unknown_generator"):
        build_source(_cfg("local", tmp_path / "pairs.jsonl"), SHAPE, 1, 0).global_batch(0)


def test_a_mark_that_is_neither_a_flag_nor_a_name_is_a_bad_type(tmp_path):
    src = build_source(_cfg("local", _pairs(tmp_path, ["painter", 1, ["sketcher"]])), SHAPE, 1, 0)
    s = src.global_batch(0)[0]  # red twice (two epochs), the others skipped each time
    assert s.gen_targets[0].shape[0] == 2 and s.gen_targets[1].shape[0] == 0
    assert set(src.skip_counts()) == {"bad_type"}


def test_one_generator_models_read_names_of_their_generator_and_true_as_before(tmp_path):
    one = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4, "painter"),))
    src = build_source(_cfg("local", _pairs(tmp_path, ["painter", True, "sketcher"])), one, 1, 0)
    s = src.global_batch(0)[0]
    assert s.gen_targets[0].shape[0] == 2 and len(s.gen_targets) == 1 and src.special.more_gens == ()
    assert src.skip_counts() == {"unknown_generator": 1}


def test_webdataset_pairs_and_documents_name_their_generator(tmp_path):
    members = [("p0.jpg", jpeg(RED)), ("p0.txt", b"red"), ("p0.json", json.dumps({"generate": "sketcher"}).encode())]
    doc = {"texts": ["Blue:", None, "green:", None], "images": [None, "0.jpg", None, "1.jpg"],
           "generate": [None, "painter", None, "sketcher"]}
    members += [("d0.json", json.dumps(doc).encode()), ("d0.0.jpg", jpeg(BLUE)), ("d0.1.jpg", jpeg(GREEN))]
    write_tar(tmp_path / "s.tar", members)
    src = open_source(_cfg("webdataset", tmp_path / "s.tar", seq_len=128, gen_images=[0, 3]), SHAPE, 1, 0)
    s = src.global_batch(0)[0]
    assert sample_problems(s, src.special, 8, 128, SHAPE.gens) == []
    assert s.gen_targets[1].shape == (2, 3, 8, 8) and s.gen_targets[0].shape == (1, 3, 16, 16)
    assert np.allclose(colour(s.gen_targets[1][0]), [1, -1, -1], atol=0.05)  # the pair's red
    assert np.allclose(colour(s.gen_targets[1][1]), [-1, 1, -1], atol=0.05)  # the document's green
    assert np.allclose(colour(s.gen_targets[0][0]), [-1, -1, 1], atol=0.05)


def test_parquet_rows_name_their_generator_and_unknown_names_are_skipped(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"jpg": [jpeg(RED), jpeg(BLUE)], "caption": ["red", "blue"],
                             "generate": ["sketcher", "nobody"]}), tmp_path / "pairs.parquet")
    src = open_source(_cfg("parquet", tmp_path / "pairs.parquet"), SHAPE, 1, 0)
    s = src.global_batch(0)[0]
    # Red for the sketcher, blue skipped, red again in the next pass: the generated-image limit.
    assert s.gen_targets[1].shape[0] == 2 and s.gen_targets[0].shape[0] == 0
    assert all(np.allclose(colour(t), [1, -1, -1], atol=0.05) for t in s.gen_targets[1])
    assert set(src.skip_counts()) == {"unknown_generator"}


def test_record_sources_may_feed_several_generators_url_sources_may_not(tmp_path):
    path = _pairs(tmp_path, ["sketcher", "painter", True])
    rgb = "model.modules.sketcher.in_channels=3"
    load_recipe("tiny_two_gen", ["data.source=local", f"data.path={path}", rgb])
    with pytest.raises(ConfigError, match="model.modules.sketcher.in_channels"):  # real targets are RGB
        load_recipe("tiny_two_gen", ["data.source=local", f"data.path={path}"])
    with pytest.raises(ConfigError, match="'data.source' laion gives generation targets to one generator only"):
        load_recipe("tiny_two_gen", ["data.source=laion", f"data.path={path}", rgb])


def _reference_losses(tmp_path: Path, marks: list) -> list[dict]:
    """Per-generator losses of a one-step reference run of tiny_two_gen on local captioned pairs whose
    ``generate`` cycles through ``marks``."""
    from disttrain_ds.runtime.reference import train_reference

    colours = [RED, BLUE, GREEN, (255, 255, 0), (0, 255, 255), (255, 0, 255)]
    for i, rgb in enumerate(colours):
        solid(tmp_path / "images" / f"{i}.png", rgb)
    lines = [{"image": f"images/{i % 6}.png", "caption": f"square number {i}", "generate": marks[i % len(marks)]}
             for i in range(12)]
    path = write_jsonl(tmp_path / "pairs.jsonl", lines)
    recipe = load_recipe("tiny_two_gen", ["layout=reference", "data.source=local", f"data.path={path}",
                                          "model.modules.sketcher.in_channels=3", "train.steps=1"])
    records, _ = train_reference(recipe, None, log=None)
    return [{k: v for k, v in r.items() if k.startswith("loss/gen/")} for r in records]


def test_a_reference_run_on_local_records_trains_each_generator_on_the_targets_named_for_it(tmp_path):
    both = _reference_losses(tmp_path / "both", ["painter", "sketcher", False])
    assert all(np.isfinite(r[f"loss/gen/{g}"]) and r[f"loss/gen/{g}"] > 0 for r in both for g in ("painter", "sketcher"))
    # Every target named for the sketcher: only its loss moves; named true: only the first generator's.
    sketcher = _reference_losses(tmp_path / "sketcher", ["sketcher", False])
    assert all(r["loss/gen/painter"] == 0 and r["loss/gen/sketcher"] > 0 for r in sketcher)
    first = _reference_losses(tmp_path / "first", [True, False])
    assert all(r["loss/gen/painter"] > 0 and r["loss/gen/sketcher"] == 0 for r in first)

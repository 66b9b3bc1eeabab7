"""Sharded data sets (webdataset tars, parquet, image folders, ``datasets`` on disk) as sources."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from disttrain_ds.data.config import DataConfig, data_problem
from disttrain_ds.data.fields import FieldsConfig
from disttrain_ds.data.registry import open_source
from disttrain_ds.data.shards import assign_shards, expand_braces, list_shards
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.errors import ConfigError
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
COLOURS = [(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0)]


def jpeg(rgb, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="JPEG")
    return buf.getvalue()


def bomb_png(side: int = 20000) -> bytes:
    """A tiny PNG whose header declares side x side pixels (a decompression bomb): only its header
    and end are real, as a check that never decodes sees them."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def pair_members(key: str, caption: str, rgb) -> list[tuple[str, bytes]]:
    """img2dataset's layout: NNN.jpg + NNN.txt + NNN.json per key."""
    meta = {"key": key, "caption": caption, "status": "success"}
    return [(f"{key}.jpg", jpeg(rgb)), (f"{key}.txt", caption.encode()), (f"{key}.json", json.dumps(meta).encode())]


def tar_shards(root: Path, n_shards: int = 4, per_shard: int = 3) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        members = []
        for i in range(per_shard):
            key = f"{s:05d}{i:04d}"
            members += pair_members(key, f"shard {s} item {i}", COLOURS[(s + i) % 4])
        write_tar(root / f"{s:05d}.tar", members)
    return str(root / ("{00000..%05d}.tar" % (n_shards - 1)))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Tar indexes and Arrow tables go under the test's folder, not the user's cache."""
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "default-cache"))


def source(src: str, path: str, batch: int = 2, seed: int = 0, **kw):
    cfg = DataConfig(**{"source": src, "path": path, "seq_len": 64, "image_sizes": [16], "gen_images": [0, 2],
                        "shuffle": False, **kw})
    assert data_problem(cfg, SHAPE.gens[0].query_tokens) is None
    return open_source(cfg, SHAPE, batch, seed)


def colour(im) -> np.ndarray:
    return im.mean(dim=(1, 2)).numpy()


def records(batch) -> list:
    return [r for s in batch for r in s.meta["records"]]


# ----------------------------------------------------------------------------- shard lists


def test_brace_ranges_keep_zero_padding_and_lists_expand():
    assert expand_braces("s/{00008..00011}.tar") == [f"s/{i:05d}.tar" for i in range(8, 12)]
    assert expand_braces("{a,b}/{1..2}.tar") == ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]


def test_a_brace_list_naming_a_missing_shard_is_one_line_naming_it(tmp_path):
    tar_shards(tmp_path, n_shards=2)
    with pytest.raises(FileNotFoundError, match=r"data.path: .*00002.tar does not exist"):
        list_shards(str(tmp_path / "{00000..00002}.tar"), (".tar",))
    cfg = DataConfig(source="webdataset", path=str(tmp_path / "*.zip"))
    assert data_problem(cfg, 4) == ("path", f"{tmp_path / '*.zip'} matches no file")
    assert data_problem(DataConfig(source="webdataset"), 4)[0] == "path"


@pytest.mark.parametrize("n_shards,parts", [(7, 3), (100, 8), (5, 5), (64, 1)])
def test_shard_parts_are_disjoint_and_cover_every_shard(n_shards, parts):
    shares = [assign_shards(n_shards, parts, j, seed=3) for j in range(parts)]
    flat = [s for share in shares for s in share]
    assert sorted(flat) == list(range(n_shards))  # covering, and no shard twice
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert shares == [assign_shards(n_shards, parts, j, seed=3) for j in range(parts)]  # same in every process
    if parts > 1 and n_shards > parts:
        assert shares != [assign_shards(n_shards, parts, j, seed=4) for j in range(parts)]


# ----------------------------------------------------------------------------- formats


def test_webdataset_tar_shards_in_img2dataset_layout_give_real_pixels(tmp_path):
    src = source("webdataset", tar_shards(tmp_path, n_shards=2, per_shard=2), gen_prob=0.0)
    batch = src.global_batch(0)
    for s in batch:
        assert sample_problems(s, src.special, 8, 64, (GenShape(16, 3, 4),)) == []
    first = batch[0]
    assert first.meta["records"][0] == (0, 0)
    assert np.allclose(colour(first.images[0]), [1, -1, -1], atol=0.05)  # 000000000.jpg is red
    assert bytes(first.input_ids[first.input_ids < 256].tolist()).decode().startswith("shard 0 item 0")
    assert src.skip_counts() == {}
    assert "webdataset" in src.describe() and "2 shards" in src.describe()


def test_webdataset_interleaved_documents_name_their_members_in_order(tmp_path):
    doc = {"texts": ["A red square.", None, "Then a blue one:", None], "images": [None, "0.jpg", None, "1.jpg"]}
    write_tar(tmp_path / "docs.tar", [("d0.json", json.dumps(doc).encode()), ("d0.0.jpg", jpeg(COLOURS[0])),
                                      ("d0.1.jpg", jpeg(COLOURS[1]))])
    s = source("webdataset", str(tmp_path / "docs.tar"), batch=1).global_batch(0)[0]
    assert s.doc_lens[0] == 13 + 6 + 17 + 6 + 1  # text, image, text, generated image, eod
    assert np.allclose(colour(s.images[0]), [1, -1, -1], atol=0.05)
    assert s.gen_targets[0].shape[0] == 1 and np.allclose(colour(s.gen_targets[0][0]), [-1, -1, 1], atol=0.05)  # last image


def test_parquet_with_image_bytes_pairs_and_interleaved_rows(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pairs = pa.table({"jpg": [jpeg(COLOURS[1]), jpeg(COLOURS[2])], "caption": ["blue", "green"]})
    pq.write_table(pairs, tmp_path / "pairs.parquet", row_group_size=1)
    docs = pa.table({"texts": [["first", None, "second", None]],
                     "images": [[None, {"bytes": jpeg(COLOURS[0]), "path": None}, None,
                                 {"bytes": jpeg(COLOURS[3]), "path": None}]]})
    pq.write_table(docs, tmp_path / "docs.parquet")
    src = source("parquet", str(tmp_path / "pairs.parquet"), gen_prob=0.0)
    s = src.global_batch(0)[0]
    assert np.allclose(colour(s.images[0]), [-1, -1, 1], atol=0.05)
    s = source("parquet", str(tmp_path / "docs.parquet"), batch=1).global_batch(0)[0]
    assert np.allclose(colour(s.images[0]), [1, -1, -1], atol=0.05)
    assert np.allclose(colour(s.gen_targets[0][0]), [1, 1, -1], atol=0.05)


def test_image_folder_with_txt_captions_in_subfolders(tmp_path):
    for sub, (name, rgb) in enumerate([("a", COLOURS[0]), ("b", COLOURS[2])]):
        d = tmp_path / f"{sub:05d}"
        d.mkdir()
        (d / f"{name}.jpg").write_bytes(jpeg(rgb))
        (d / f"{name}.txt").write_text(f"picture {name}")
    src = source("folder", str(tmp_path), gen_prob=0.0)
    batch = src.global_batch(0)
    assert "2 shards" in src.describe()
    assert np.allclose(colour(batch[0].images[0]), [1, -1, -1], atol=0.05)
    assert np.allclose(colour(batch[0].images[1]), [-1, 1, -1], atol=0.05)


def test_hf_save_to_disk_folder_with_image_feature_read_offline(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (40, 30), COLOURS[1]), Image.new("RGB", (40, 30), COLOURS[0])],
         "text": ["blue square", "red square"]},
        features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "ds"))
    src = source("hf", str(tmp_path / "ds"), gen_prob=0.0, cache_dir=str(tmp_path / "cache"))
    s = src.global_batch(0)[0]
    assert np.allclose(colour(s.images[0]), [-1, -1, 1], atol=0.05)
    assert bytes(s.input_ids[s.input_ids < 256].tolist()).decode().startswith("blue square")


def test_field_names_are_configurable(tmp_path):
    write_tar(tmp_path / "x.tar", [("k.png", jpeg(COLOURS[0])), ("k.json", json.dumps({"alt": "custom"}).encode())])
    fields = FieldsConfig(caption=["json.alt"], image=["png"])
    s = source("webdataset", str(tmp_path / "x.tar"), batch=1, fields=fields, gen_prob=0.0).global_batch(0)[0]
    assert bytes(s.input_ids[s.input_ids < 256].tolist()).decode().startswith("custom")


# ----------------------------------------------------------------------------- bad records


def test_records_lacking_fields_or_with_bad_images_are_skipped_by_reason(tmp_path):
    members = pair_members("ok", "a caption long enough to fill most of a sequence", COLOURS[0])
    members += [("nocap.jpg", jpeg(COLOURS[1]))]                       # image, no caption
    members += [("noimg.txt", b"caption without image")]               # caption, no image
    members += [("other.cls", b"3")]                                    # neither
    members += [("bomb.png", bomb_png()), ("bomb.txt", b"decompression bomb")]
    members += [("cut.jpg", jpeg(COLOURS[2])[:300]), ("cut.txt", b"truncated")]
    members += [("junk.jpg", b"not an image"), ("junk.txt", b"junk")]
    members += [("latin.jpg", jpeg(COLOURS[0])), ("latin.txt", "caf\xe9".encode("latin-1"))]
    members += [("badjson.jpg", jpeg(COLOURS[0])), ("badjson.json", b"{nope")]
    write_tar(tmp_path / "mixed.tar", members)
    src = source("webdataset", str(tmp_path / "mixed.tar"), batch=1, max_image_pixels=1 << 20)
    src.global_batch(0)
    assert src.skip_counts() == {"bad_json": 1, "corrupt_image": 2, "image_too_large": 1, "missing_caption": 1,
                                 "missing_fields": 1, "missing_image": 1, "not_utf8": 1}


def test_a_decompression_bomb_is_refused_per_record_not_per_job(tmp_path):
    write_tar(tmp_path / "b.tar", pair_members("b", "a caption long enough to fill most of a sequence", COLOURS[2])
              + [("c.png", bomb_png(8000)), ("c.txt", b"bomb")])
    src = source("webdataset", str(tmp_path / "b.tar"), batch=1, gen_prob=0.0)  # default limit 4096 x 4096
    s = src.global_batch(0)[0]
    assert src.skip_counts() == {"image_too_large": 1}
    assert np.allclose(colour(s.images[0]), [-1, 1, -1], atol=0.05)
    # Negative control: under a limit above its header's 64 million pixels the same record is planned.
    lax = source("webdataset", str(tmp_path / "b.tar"), batch=1, gen_prob=0.0, max_image_pixels=8000 * 8000)
    lax.plan(0)
    assert lax._cursors[1].skips == ()
    # Over PIL's own limit (about 179 million pixels) no setting lets it through.
    write_tar(tmp_path / "huge.tar", pair_members("b", "a caption long enough to fill most of a sequence", COLOURS[2])
              + [("c.png", bomb_png(20000)), ("c.txt", b"bomb")])
    huge = source("webdataset", str(tmp_path / "huge.tar"), batch=1, gen_prob=0.0, max_image_pixels=20000 * 20000)
    huge.plan(0)
    assert huge._cursors[1].skips == (("image_too_large", 1),)


def test_a_source_with_no_usable_record_names_the_expected_fields_in_one_line(tmp_path):
    write_tar(tmp_path / "wrong.tar", [("a.png", jpeg(COLOURS[0])), ("a.label", b"cat")])
    src = source("webdataset", str(tmp_path / "wrong.tar"), batch=1, fields=FieldsConfig(image=["png"]))
    with pytest.raises(ConfigError) as err:
        src.global_batch(0)
    msg = str(err.value)
    assert "\n" not in msg and "no usable records" in msg and "missing_caption" in msg
    assert "caption field txt | caption | text" in msg and "data.fields" in msg


# ----------------------------------------------------------------------------- order, resume, parts


def test_order_is_deterministic_for_a_seed_and_resumes_exactly_from_json_state(tmp_path):
    path = tar_shards(tmp_path, n_shards=4, per_shard=3)
    straight = source("webdataset", path, seed=5, shuffle=True)
    runs = [straight.global_batch(s) for s in range(6)]
    again = source("webdataset", path, seed=5, shuffle=True)
    assert records(again.global_batch(3)) == records(runs[3])
    other = source("webdataset", path, seed=6, shuffle=True)
    assert [records(other.global_batch(s)) for s in range(3)] != [records(b) for b in runs[:3]]
    first = source("webdataset", path, seed=5, shuffle=True)
    for s in range(3):
        first.global_batch(s)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = source("webdataset", path, seed=5, shuffle=True)
    resumed.load_state_dict(state)
    for s in range(3, 6):
        got = resumed.global_batch(s)
        assert records(got) == records(runs[s])
        assert all(a.input_ids.equal(b.input_ids) for a, b in zip(got, runs[s]))
    assert resumed.records_parsed < straight.records_parsed  # it did not re-read the steps before


def test_each_part_reads_only_its_own_shards(tmp_path, monkeypatch):
    from disttrain_ds.data import tables

    path = tar_shards(tmp_path, n_shards=6, per_shard=2)
    opened: list[str] = []
    real = tables.TarTable._index
    monkeypatch.setattr(tables.TarTable, "_index", staticmethod(lambda p: (opened.append(Path(p).name), real(p))[1]))
    src = source("webdataset", path, batch=4, seed=2, shard_parts=2, cache_dir=str(tmp_path / "c"))
    shares = [sorted(f"{s:05d}.tar" for s in assign_shards(6, 2, j, 2)) for j in range(2)]
    assert sorted(opened) == shares[0]  # opening the source indexes part 0 only
    part1 = src.part_batch(0, 1)
    assert sorted(opened) == sorted(shares[0] + shares[1])
    read = {int(m) for s in part1 for m in re.findall(r"shard (\d+) item", bytes(s.input_ids[s.input_ids < 256].tolist()).decode())}
    assert read and read <= {int(n[:5]) for n in shares[1]}  # its samples come from its shards alone
    batch = src.global_batch(0)
    assert [s.sample_id for s in batch] == [0, 1, 2, 3]
    state = json.loads(json.dumps(src.state_dict()))
    again = source("webdataset", path, batch=4, seed=2, shard_parts=2, cache_dir=str(tmp_path / "c"))
    again.load_state_dict(state)
    assert sorted(opened) == sorted(shares[0] + shares[1])  # the second source reads the cached indexes
    for s in range(1, 3):
        assert [x.input_ids.tolist() for x in again.global_batch(s)] == [x.input_ids.tolist() for x in src.global_batch(s)]


def test_shard_parts_must_divide_the_batch_and_not_exceed_the_shards(tmp_path):
    path = tar_shards(tmp_path, n_shards=2, per_shard=1)
    with pytest.raises(ValueError, match="data.shard_parts: 3 does not divide"):
        source("webdataset", path, batch=4, shard_parts=3)
    with pytest.raises(ValueError, match="data.shard_parts: 4 parts but .* only 2 shards"):
        source("webdataset", path, batch=4, shard_parts=4)


def test_url_sources_say_their_images_are_stand_ins(tmp_path):
    (tmp_path / "l.jsonl").write_text(json.dumps({"caption": "a cat", "url": "http://x/cat.jpg"}) + "\n")
    line = source("laion", str(tmp_path / "l.jsonl"), batch=1, cache_dir=str(tmp_path / "c")).describe()
    assert "stand-in" in line and "not fetched" in line


def test_a_compressed_tar_is_refused_in_one_line_naming_it(tmp_path):
    import gzip

    write_tar(tmp_path / "plain.tar", pair_members("a", "x", COLOURS[0]))
    (tmp_path / "z.tar").write_bytes(gzip.compress((tmp_path / "plain.tar").read_bytes()))
    with pytest.raises(ValueError, match=r"^data.path: .*z.tar is not an uncompressed tar"):
        source("webdataset", str(tmp_path / "z.tar"))


def test_hf_source_reads_parquet_files_through_datasets(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = pa.table({"image": [{"bytes": jpeg(COLOURS[2]), "path": None}], "caption": ["green"]})
    pq.write_table(rows, tmp_path / "train-00000.parquet")
    src = source("hf", str(tmp_path / "*.parquet"), batch=1, gen_prob=0.0, cache_dir=str(tmp_path / "cache"))
    assert np.allclose(colour(src.global_batch(0)[0].images[0]), [-1, 1, -1], atol=0.05)


def test_empty_field_name_lists_are_refused_when_the_recipe_loads(tmp_path):
    path = tar_shards(tmp_path, n_shards=1, per_shard=1)
    cfg = DataConfig(source="webdataset", path=path, fields=FieldsConfig(caption=[]))
    assert data_problem(cfg, 4) == ("fields.caption", "needs at least one non-empty field name")
    assert data_problem(DataConfig(source="webdataset", path=path, shard_parts=0), 4)[0] == "shard_parts"


def test_planning_reads_only_the_start_and_end_of_a_large_tar_member(tmp_path, monkeypatch):
    from disttrain_ds.data import blobs

    big = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (600, 600, 3), dtype=np.uint8)).save(big, "JPEG", quality=95)
    assert len(big.getvalue()) > 4 * blobs._HEAD
    write_tar(tmp_path / "big.tar", [("a.jpg", big.getvalue()), ("a.txt", b"noise")])
    reads: list[int] = []
    real = blobs.pread
    monkeypatch.setattr(blobs, "pread", lambda p, o, n: (reads.append(n), real(p, o, n))[1])
    src = source("webdataset", str(tmp_path / "big.tar"), batch=1, gen_prob=0.0)
    src.plan(0)
    assert max(reads) == blobs._HEAD  # the caption, the image's first 64 KiB and last bytes, per record parsed
    s = src.global_batch(0)[0]  # decoding reads it whole
    assert max(reads) == len(big.getvalue()) and len(s.images) >= 1 and src.skip_counts() == {}
    # A truncated large member is still caught from its tail.
    write_tar(tmp_path / "cut.tar", pair_members("b", "a caption long enough to fill most of a sequence", COLOURS[0])
              + [("c.jpg", big.getvalue()[:-100]), ("c.txt", b"noise")])
    cut = source("webdataset", str(tmp_path / "cut.tar"), batch=1, gen_prob=0.0)
    cut.plan(0)
    assert cut._cursors[1].skips == (("corrupt_image", 1),)


def test_the_new_keys_leave_the_data_state_of_jsonl_sources_as_it_was(tmp_path):
    (tmp_path / "l.jsonl").write_text(json.dumps({"caption": "a cat", "url": "http://x/cat.jpg"}) + "\n")
    kw = dict(batch=1, cache_dir=str(tmp_path / "c"))
    plain = source("laion", str(tmp_path / "l.jsonl"), **kw)
    other = source("laion", str(tmp_path / "l.jsonl"), fields=FieldsConfig(caption=["alt"]), **kw)
    assert plain._fingerprint() == other._fingerprint()  # checkpoints written before these keys still resume
    path = tar_shards(tmp_path / "t", n_shards=1, per_shard=1)
    assert source("webdataset", path, **kw)._fingerprint() != source("webdataset", path, fields=FieldsConfig(caption=["alt", "txt"]), **kw)._fingerprint()


def test_interleaved_documents_in_a_folder_and_in_a_datasets_table(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "d.json").write_text(json.dumps({"texts": ["Red:", None, "Now blue:", None], "images": [None, "0.jpg", None, "1.jpg"]}))
    (folder / "d.0.jpg").write_bytes(jpeg(COLOURS[0]))
    (folder / "d.1.jpg").write_bytes(jpeg(COLOURS[1]))
    s = source("folder", str(folder), batch=1).global_batch(0)[0]
    assert np.allclose(colour(s.images[0]), [1, -1, -1], atol=0.05)
    assert np.allclose(colour(s.gen_targets[0][0]), [-1, -1, 1], atol=0.05)
    red, blue = (Image.new("RGB", (40, 30), c) for c in COLOURS[:2])
    ds = datasets.Dataset.from_dict(
        {"texts": [["Red:", None, "Now blue:", None]], "images": [[None, red, None, blue]]},
        features=datasets.Features({"texts": datasets.List(datasets.Value("string")), "images": datasets.List(datasets.Image())}))
    ds.save_to_disk(str(tmp_path / "ds"))
    s = source("hf", str(tmp_path / "ds"), batch=1, cache_dir=str(tmp_path / "c")).global_batch(0)[0]
    assert np.allclose(colour(s.images[0]), [1, -1, -1], atol=0.05)
    assert np.allclose(colour(s.gen_targets[0][0]), [-1, -1, 1], atol=0.05)


def test_a_rewritten_shard_is_indexed_again(tmp_path):
    write_tar(tmp_path / "s.tar", pair_members("a", "first", COLOURS[0]))
    assert len(source("webdataset", str(tmp_path / "s.tar")).table) == 1
    write_tar(tmp_path / "s.tar", pair_members("a", "first", COLOURS[0]) + pair_members("b", "second", COLOURS[1]))
    assert len(source("webdataset", str(tmp_path / "s.tar")).table) == 2
    assert len(list((tmp_path / "default-cache" / "tar_index").iterdir())) == 2


def test_random_garbage_records_are_skipped_with_a_known_reason_never_raised(tmp_path):
    """Fields of every shape in every slot: each record parses to a document or a counted skip."""
    from disttrain_ds.data.entry_parse import parse_entry
    from disttrain_ds.data.formats import Bad, Document, ParseContext
    from disttrain_ds.data.tables import BlobAt
    from disttrain_ds.data.tokenizer import load_tokenizer

    good = tmp_path / "g.jpg"
    good.write_bytes(jpeg(COLOURS[0]))
    (tmp_path / "bad.jpg").write_bytes(b"\x89PNG junk")
    write_tar(tmp_path / "b.tar", [("x.png", bomb_png())])
    import tarfile as tf_mod

    with tf_mod.open(tmp_path / "b.tar") as tf:
        m = tf.getmembers()[0]
        bomb = BlobAt("blob", json.dumps(["tar", str(tmp_path / "b.tar"), m.offset_data, m.size]))
    values = [None, "", "  ", "text", "caf\udcff", 5, 2.5, True, [], {}, b"", b"\xff\xfe", "0.jpg", [None],
              ["a", None], [None, "0.jpg"], [1, 2], {"bytes": None}, {"caption": "x"},
              BlobAt("file", str(good)), BlobAt("file", str(tmp_path / "bad.jpg")), BlobAt("file", str(tmp_path / "no.jpg")),
              bomb, BlobAt("blob", json.dumps(["tar", str(tmp_path / "gone.tar"), 0, 10])), BlobAt("blob", "not json")]
    names = ["txt", "jpg", "json", "texts", "images", "generate", "0.jpg", "caption"]
    cfg = DataConfig(seq_len=64, image_sizes=[16], gen_images=[0, 2])
    ctx = ParseContext(cfg, load_tokenizer("byte", ""), 8, (4,), 0)
    rng = np.random.default_rng(0)
    known = {"missing_fields", "missing_caption", "missing_image", "empty_text", "bad_type", "bad_image", "bad_json",
             "not_utf8", "corrupt_image", "image_too_large", "missing_image", "too_long", "too_many_images"}
    seen = set()
    for _ in range(600):
        record = {n: values[rng.integers(len(values))] for n in rng.choice(names, size=int(rng.integers(0, 5)), replace=False)}
        if rng.random() < 0.2:  # a json member with fields of its own (JSON values only)
            plain = [v for v in values if isinstance(v, (str, int, float, list, dict, type(None))) and v != "caf\udcff"]
            doc = {names[rng.integers(len(names))]: plain[rng.integers(len(plain))] for _ in range(2)}
            record["json"] = json.dumps(doc).encode() if rng.random() < 0.8 else b"{broken"
        out = parse_entry(record, FieldsConfig(), ctx, np.random.default_rng(0))
        assert isinstance(out, (Document, Bad)), record
        if isinstance(out, Bad):
            assert out.reason in known, (out.reason, record)
        seen.add(type(out).__name__ if isinstance(out, Document) else out.reason)
    assert "Document" in seen and {"image_too_large", "corrupt_image", "missing_fields", "bad_type"} <= seen

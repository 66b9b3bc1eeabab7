"""Audio clips in sharded data sets (webdataset, parquet, folder, hf): captioned clips and interleaved documents."""

from __future__ import annotations

import io
import json
import re
import wave

import numpy as np
import pytest
import torch
from test_data_formats import jpeg, write_tar  # tests/unit is on sys.path under pytest

from disttrain_ds.data.audio import HOP, SAMPLE_RATE, load_clip
from disttrain_ds.data.config import DataConfig, data_problem
from disttrain_ds.data.fields import FieldsConfig
from disttrain_ds.data.registry import open_source
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.samples import GenShape, ShapeSpec

EAR = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),), audio_mels=16, audio_max_frames=64)
NO_EAR = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
WITH_NPY = FieldsConfig(audio=["wav", "npy", "audio"])


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "default-cache"))


def wav_bytes(frames: int, hz: float = 440.0) -> bytes:
    t = np.arange(frames * HOP) / SAMPLE_RATE
    x = 0.3 * np.sin(2 * np.pi * hz * t)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def npy_bytes(frames: int, value: float = 0.5) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.full((16, frames), value, dtype=np.float32))
    return buf.getvalue()


def source(src: str, path, shape: ShapeSpec = EAR, batch: int = 1, **kw):
    cfg = DataConfig(**{"source": src, "path": str(path), "seq_len": 64, "image_sizes": [16], "gen_images": [0, 0],
                        "gen_prob": 0.0, "max_audio": 2, "max_images": 1, "shuffle": False, **kw})
    assert data_problem(cfg, shape.gens[0].query_tokens) is None
    return open_source(cfg, shape, batch, 0)


def epoch(src, steps: int) -> list:
    """Every sample of the first ``steps`` steps, each checked against the sample contract."""
    out = [s for step in range(steps) for s in src.global_batch(step)]
    for s in out:
        assert sample_problems(s, src.special, 8, src.cfg.seq_len, (GenShape(16, 3, 4),)) == []
    return out


def reference(tmp_path, data: bytes, name: str) -> torch.Tensor:
    """The clip as the local source reads it from a file with the same bytes."""
    (tmp_path / name).write_bytes(data)
    return load_clip(tmp_path / name, 16, 64)


def test_webdataset_reads_captioned_clips_and_interleaved_clips_skipping_records_without_audio(tmp_path):
    tone, feats = wav_bytes(21), npy_bytes(12)  # 21 frames: cut to 20, 10 placeholders
    write_tar(tmp_path / "a.tar", [
        ("a.wav", tone), ("a.txt", b"a tone"),
        ("b.npy", feats), ("b.txt", b"a log-mel array"),
        ("c.txt", b"a caption alone"),
        ("d.wav", b"RIFF not really"), ("d.txt", b"a broken clip"),
        ("e.json", json.dumps({"texts": ["Listen:", None, "then more"], "audios": [None, "0.wav", None]}).encode()),
        ("e.0.wav", wav_bytes(30, 880.0)),
        ("f.json", json.dumps({"texts": ["Gone:", None], "audios": [None, "9.wav"]}).encode()),
    ])
    src = source("webdataset", tmp_path / "a.tar", fields=WITH_NPY)
    samples = epoch(src, 3)
    clips = [c for s in samples for c in s.audio]  # records in order: a, b, e (c, d and f skipped), a ...
    assert [c.shape[1] for c in clips[:4]] == [20, 12, 30, 20]
    torch.testing.assert_close(clips[0], reference(tmp_path, tone, "tone.wav"))
    assert torch.equal(clips[1], torch.full((16, 12), 0.5))
    torch.testing.assert_close(clips[2], reference(tmp_path, wav_bytes(30, 880.0), "e.wav"))
    first = samples[0]
    assert int((first.input_ids == src.special.audio).sum()) == sum(c.shape[1] // 2 for c in first.audio)
    # The document's clip sits between its texts (its pieces may span two sequences).
    stream = "".join(chr(i) if i < 256 else "@" if i == src.special.audio else "#" for s in samples for i in s.input_ids.tolist())
    assert re.search(r"Listen:#*@{15}#* then more", stream)
    assert set(src.skip_counts()) == {"missing_audio", "bad_audio"}  # c lacks audio, d is broken, f names no member
    # The same tar in a model without an audio encoder: the audio fields are never looked at.
    plain = source("webdataset", tmp_path / "a.tar", shape=NO_EAR, max_audio=0, fields=WITH_NPY)
    (s,) = plain.global_batch(0)
    assert not s.audio and plain.special.audio == -1 and "missing_image" in plain.skip_counts()


def test_parquet_rows_hold_clip_bytes_for_pairs_and_aligned_lists_for_documents(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    tone = wav_bytes(24)
    pq.write_table(pa.table({"txt": ["a tone", "no clip"], "wav": [tone, None]}), tmp_path / "pairs.parquet")
    src = source("parquet", tmp_path / "pairs.parquet")
    (s,) = epoch(src, 1)
    torch.testing.assert_close(s.audio[0], reference(tmp_path, tone, "t.wav"))
    src.global_batch(1)
    assert set(src.skip_counts()) == {"missing_audio"}
    docs = pa.table({"texts": [["Hear", None, "and see", None]], "images": [[None, None, None, jpeg((255, 0, 0))]],
                     "audios": [[None, {"bytes": npy_bytes(8, 0.25)}, None, None]]})
    pq.write_table(docs, tmp_path / "docs.parquet")
    (s,) = epoch(source("parquet", tmp_path / "docs.parquet"), 1)
    assert torch.equal(s.audio[0], torch.full((16, 8), 0.25)) and len(s.images) == 1
    ids = s.input_ids.tolist()
    assert ids.index(src.special.audio) < ids.index(src.special.image)  # reading order kept


def test_folder_clips_are_wav_and_npy_files_beside_their_captions(tmp_path):
    shard = tmp_path / "00000"
    shard.mkdir()
    (shard / "a.wav").write_bytes(wav_bytes(16))
    (shard / "a.txt").write_text("a wav file")
    (shard / "b.npy").write_bytes(npy_bytes(10))
    (shard / "b.txt").write_text("an npy file")
    (shard / "c.jpg").write_bytes(jpeg((0, 0, 255)))
    (shard / "c.wav").write_bytes(wav_bytes(12))
    (shard / "c.txt").write_text("a picture with a sound")
    src = source("folder", tmp_path, fields=WITH_NPY)
    samples = epoch(src, 3)
    assert [c.shape[1] for s in samples for c in s.audio][:3] == [16, 10, 12]
    torch.testing.assert_close(samples[0].audio[0], load_clip(shard / "a.wav", 16, 64))
    both = next(s for s in samples if any(c.shape[1] == 12 for c in s.audio))
    assert len(both.images) == 1  # both media of a captioned pair are read
    assert src.skip_counts() == {}


def test_hf_audio_feature_columns_are_read_undecoded_offline(tmp_path):
    datasets, pa = pytest.importorskip("datasets"), pytest.importorskip("pyarrow")
    tone = wav_bytes(18)
    # Written as Arrow with the Audio feature's own struct (encoding through datasets needs torchcodec).
    table = pa.table({"audio": pa.array([{"bytes": tone, "path": None}, None], type=datasets.Audio().pa_type),
                      "text": ["an audio feature", "nothing to hear"]})
    features = datasets.Features({"audio": datasets.Audio(), "text": datasets.Value("string")})
    datasets.Dataset(table, info=datasets.DatasetInfo(features=features)).save_to_disk(str(tmp_path / "ds"))
    src = source("hf", tmp_path / "ds", cache_dir=str(tmp_path / "c"))
    (s,) = epoch(src, 1)
    torch.testing.assert_close(s.audio[0], reference(tmp_path, tone, "h.wav"))
    src.global_batch(1)
    assert set(src.skip_counts()) == {"missing_audio"}


def test_a_sequence_never_holds_more_clips_than_max_audio(tmp_path):
    write_tar(tmp_path / "d.tar", [
        ("d.json", json.dumps({"texts": ["one", None, "two", None, "three"], "audios": [None, "0.wav", None, "1.wav", None]}).encode()),
        ("d.0.wav", wav_bytes(8)), ("d.1.wav", wav_bytes(10)),
        ("p.wav", wav_bytes(8)), ("p.txt", b"pair"),
    ])
    src = source("webdataset", tmp_path / "d.tar", max_audio=1, batch=2)
    samples = epoch(src, 2)
    assert all(len(s.audio) <= 1 for s in samples) and sum(len(s.audio) for s in samples) >= 3

"""Audio clips as data: Whisper's log-mel front end, the synthetic audio source, .wav / .npy clips."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import torch

from disttrain_ds.data.audio import HOP, SAMPLE_RATE, load_clip, log_mel, read_wav, synthetic_clip
from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.source import SyntheticSource
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.samples import GenShape, PackedSample, ShapeSpec, SpecialTokens


def _tone(frames: int, hz: float = 440.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(frames * HOP) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def test_log_mel_equals_transformers_whisper_feature_extractor():
    from transformers import WhisperFeatureExtractor

    x = _tone(40)
    ref = WhisperFeatureExtractor(feature_size=16)._np_extract_fbank_features(x[None], "cpu")[0]
    ours = log_mel(torch.tensor(x), 16)
    assert ours.shape == (16, 40) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5)


def test_synthetic_clips_are_seeded_and_as_long_as_asked():
    a = synthetic_clip(np.random.default_rng([1, 2]), 16, 24)
    b = synthetic_clip(np.random.default_rng([1, 2]), 16, 24)
    c = synthetic_clip(np.random.default_rng([1, 3]), 16, 24)
    assert a.shape == (16, 24) and torch.equal(a, b) and not torch.equal(a, c)


def _wav(path, samples: np.ndarray, rate: int = SAMPLE_RATE) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())


def test_wav_and_npy_clips_load_as_log_mel_cut_to_an_even_length(tmp_path):
    x = _tone(31)
    _wav(tmp_path / "a.wav", x)
    np.testing.assert_allclose(read_wav(tmp_path / "a.wav").numpy(), x, atol=1e-4)
    clip = load_clip(tmp_path / "a.wav", 16, max_frames=64)
    assert clip.shape == (16, 30)  # 31 frames, cut to even for the stride-2 convolution
    torch.testing.assert_close(clip, log_mel(read_wav(tmp_path / "a.wav"), 16)[:, :30])
    np.save(tmp_path / "m.npy", np.ones((16, 50), dtype=np.float32))
    assert load_clip(tmp_path / "m.npy", 16, max_frames=40).shape == (16, 40)


@pytest.mark.parametrize("name, make, needle", [
    ("slow.wav", lambda p: _wav(p, _tone(4), rate=8000), "8000 Hz audio"),
    ("m.npy", lambda p: np.save(p, np.ones((8, 10), dtype=np.float32)), "expected (16, frames)"),
    ("a.mp3", lambda p: p.write_bytes(b"x"), ".wav files or .npy log-mel arrays"),
])
def test_unreadable_clips_are_one_line_errors_naming_the_file(tmp_path, name, make, needle):
    make(tmp_path / name)
    with pytest.raises(ValueError) as e:
        load_clip(tmp_path / name, 16, max_frames=64)
    assert name in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)


def _source(max_audio: int, audio_mels: int = 16) -> SyntheticSource:
    cfg = DataConfig(seq_len=160, image_sizes=[16], max_images=1, max_audio=max_audio, audio_frames=[8, 40])
    return SyntheticSource(cfg, ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),), audio_mels=audio_mels), global_batch=8, seed=3)


def test_synthetic_samples_carry_clips_with_one_placeholder_per_encoder_row():
    src = _source(max_audio=2)
    batch = src.global_batch(0)
    assert batch[0].audio and src.special.audio == src.special.eod + 1
    lengths = set()
    for s in batch:
        assert sample_problems(s, src.special, 8, 160, (GenShape(16, 3, 4),)) == []
        rows = sum(c.shape[1] // 2 for c in s.audio)
        assert int((s.input_ids == src.special.audio).sum()) == rows
        assert all(c.shape[0] == 16 and c.shape[1] % 2 == 0 and 8 <= c.shape[1] <= 40 for c in s.audio)
        assert not (s.labels == src.special.audio).any()  # placeholders are never targets
        assert s.stats(8, src.special).audio_frames == tuple(c.shape[1] for c in s.audio)
        lengths |= {c.shape[1] for c in s.audio}
    assert len(lengths) > 1  # clip lengths vary
    again = _source(max_audio=2).global_batch(0)
    assert all(torch.equal(a, b) for s, t in zip(batch, again) for a, b in zip(s.audio, t.audio))


def test_models_without_an_audio_encoder_see_the_same_samples_and_vocabulary_as_before():
    plain, audio_off = _source(max_audio=0, audio_mels=0), _source(max_audio=2, audio_mels=0)
    assert plain.special == SpecialTokens.after(256) and plain.special.vocab_size == 262
    for s, t in zip(plain.global_batch(1), audio_off.global_batch(1)):
        assert torch.equal(s.input_ids, t.input_ids) and not s.audio and not t.audio


def test_a_clip_without_its_placeholders_breaks_the_sample_contract():
    src = _source(max_audio=2)
    s = src.global_batch(0)[0]
    s.audio.append(s.audio[0])
    assert any("audio placeholder runs" in p for p in sample_problems(s, src.special, 8, 160, (GenShape(16, 3, 4),)))


def test_samples_with_clips_survive_the_plain_round_trip():
    s = _source(max_audio=2).global_batch(0)[0]
    back = PackedSample.from_plain(s.to_plain())
    assert len(back.audio) == len(s.audio) and all(torch.equal(a, b) for a, b in zip(back.audio, s.audio))
    old = {k: v for k, v in s.to_plain().items() if k != "audio"}  # written before clips existed
    assert PackedSample.from_plain(old).audio == []


def test_local_documents_read_wav_and_npy_clips_into_audio_placeholders(tmp_path):
    import json

    from disttrain_ds.data.producers import build_source

    _wav(tmp_path / "tone.wav", _tone(21))  # 21 frames: cut to 20, 10 placeholders
    np.save(tmp_path / "feat.npy", np.full((16, 12), 0.5, dtype=np.float32))
    records = [
        {"segments": [{"text": "Listen:"}, {"audio": "tone.wav"}, {"text": "then"}, {"audio": "feat.npy"}]},
        {"segments": [{"text": "Broken:"}, {"audio": "missing.wav"}]},
        {"segments": [{"text": "Bad type:"}, {"audio": 3}]},
    ]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source="local", path=str(tmp_path), seq_len=64, shuffle=False, max_images=0, gen_images=[0, 0],
                     max_audio=2)
    shape = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),), audio_mels=16, audio_max_frames=64)
    with build_source(cfg, shape, 1, 0) as src:
        s = src.global_batch(0)[0]
        assert [c.shape[1] for c in s.audio] == [20, 12] and sample_problems(s, src.special, 8, 64, (GenShape(16, 3, 4),)) == []
        torch.testing.assert_close(s.audio[0], load_clip(tmp_path / "tone.wav", 16, 64))
        assert torch.equal(s.audio[1], torch.full((16, 12), 0.5))
        assert int((s.input_ids == src.special.audio).sum()) == 16
        src.global_batch(1)
        assert set(src.skip_counts()) == {"bad_audio"}  # the missing file and the number, each epoch
    no_encoder = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
    (tmp_path / "docs.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps({"segments": [{"text": "ok"}]}) + "\n")
    with build_source(cfg, no_encoder, 1, 0) as src:
        assert not src.global_batch(0)[0].audio and set(src.skip_counts()) == {"no_audio_encoder"}


def test_clips_prepared_in_producer_processes_arrive_unchanged():
    import dataclasses

    from disttrain_ds.data.producers import build_source

    inline = _source(max_audio=2)
    with build_source(dataclasses.replace(inline.cfg, producers=1), inline.shape, 8, 3) as src:
        for s, t in zip(inline.global_batch(0), src.global_batch(0)):
            assert len(s.audio) == len(t.audio) and all(torch.equal(a, b) for a, b in zip(s.audio, t.audio))

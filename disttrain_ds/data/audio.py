"""Audio clips as the audio encoder reads them: log-mel features [n_mels, frames].

Whisper's front end, written with torch only (no torchaudio): a Hann-windowed STFT with hop
``HOP`` and window ``N_FFT`` at ``SAMPLE_RATE``, power spectrum, a Slaney-style triangular mel
filter bank, ``log10`` clamped to 8 decades below the clip's peak and scaled ``(x + 4) / 4``.
Each frame covers ``HOP`` samples (10 ms at 16 kHz), so a clip of ``f`` frames is ``f * HOP``
samples long; the audio encoder's stride-2 convolution makes ``f // 2`` rows of it.

Sources: ``synthetic_clip`` (seeded tones and noise, any length), ``load_clip`` (a .wav file read
with the standard ``wave`` module, or a .npy array of log-mel features) and ``load_clip_bytes``
(the same stored as bytes inside a shard: a tar member, a parquet or ``datasets`` cell).
"""

from __future__ import annotations

import functools
import io
import wave
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16000
"""Samples per second the front end works at (Whisper's)."""
N_FFT = 400
"""STFT window in samples (25 ms)."""
HOP = 160
"""Samples between frames (10 ms)."""


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    lin = f / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters, area-normalised (Slaney), as Whisper's."""
    freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    lower = (freqs[None, :] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None])
    upper = (edges[2:, None] - freqs[None, :]) / (edges[2:, None] - edges[1:-1, None])
    bank = np.maximum(0.0, np.minimum(lower, upper)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.tensor(bank, dtype=torch.float32)


def log_mel(samples: torch.Tensor, n_mels: int, frames: int | None = None) -> torch.Tensor:
    """float32 [n_mels, frames] log-mel features of a mono waveform at ``SAMPLE_RATE`` in [-1, 1].

    ``frames`` (default ``len // HOP``) cuts or zero-pads the waveform to ``frames * HOP`` samples."""
    x = samples.to(torch.float32).reshape(-1)
    frames = x.numel() // HOP if frames is None else frames
    if frames < 1:
        raise ValueError(f"an audio clip needs at least {HOP} samples (one frame), got {x.numel()}")
    x = torch.nn.functional.pad(x[: frames * HOP], (0, max(0, frames * HOP - x.numel())))
    spec = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), center=True, pad_mode="reflect",
                      return_complex=True)[:, :frames]
    mel = mel_filters(n_mels) @ spec.abs().pow(2)
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).contiguous()


def synthetic_clip(rng: np.random.Generator, n_mels: int, frames: int) -> torch.Tensor:
    """Log-mel features of a seeded clip: a few tones with slow vibrato plus a little noise."""
    t = np.arange(frames * HOP) / SAMPLE_RATE
    wave_ = np.zeros_like(t)
    for _ in range(int(rng.integers(1, 4))):
        f0, depth, rate, amp = rng.uniform(120, 3000), rng.uniform(0, 40), rng.uniform(1, 6), rng.uniform(0.1, 0.4)
        wave_ += amp * np.sin(2 * np.pi * f0 * t + depth * np.sin(2 * np.pi * rate * t))
    wave_ += 0.01 * rng.standard_normal(t.shape)
    return log_mel(torch.tensor(wave_, dtype=torch.float32), n_mels, frames)


def read_wav(path: str | Path | io.BytesIO, where: str = "") -> torch.Tensor:
    """Mono float32 samples in [-1, 1] of a PCM .wav at ``SAMPLE_RATE`` (8/16/32-bit, channels
    averaged); ``path`` may be an open binary stream (``where`` then names it in errors)."""
    where = where or str(path)
    with _open_wav(path, where) as w:
        rate, width, channels, n = w.getframerate(), w.getsampwidth(), w.getnchannels(), w.getnframes()
        raw = w.readframes(n)
    if rate != SAMPLE_RATE:
        raise ValueError(f"{where}: {rate} Hz audio; the audio encoder reads {SAMPLE_RATE} Hz (resample it first)")
    if width == 1:
        data = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        kind = np.int16 if width == 2 else np.int32
        data = np.frombuffer(raw, dtype=kind).astype(np.float32) / float(np.iinfo(kind).max + 1)
    else:
        raise ValueError(f"{where}: {8 * width}-bit samples; 8, 16 or 32-bit PCM is read")
    return torch.from_numpy(data[: len(data) // channels * channels].reshape(-1, channels).mean(axis=1).copy())


def _open_wav(src, where: str) -> wave.Wave_read:
    try:
        return wave.open(src if isinstance(src, io.BytesIO) else str(src), "rb")
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{where}: not a PCM .wav file ({exc})") from None


def _even(frames: int, max_frames: int, where: str) -> int:
    """A clip's frame count cut to ``max_frames`` and to an even number (the stride-2 convolution)."""
    frames = min(frames, max_frames) // 2 * 2
    if frames < 2:
        raise ValueError(f"{where}: shorter than 2 mel frames ({2 * HOP} samples)")
    return frames


def _npy_frames(shape: tuple, n_mels: int, where: str) -> int:
    if len(shape) != 2 or shape[0] != n_mels:
        raise ValueError(f"{where}: log-mel array of shape {shape}; expected ({n_mels}, frames)")
    return int(shape[1])


def _kind(path: Path) -> str:
    if path.suffix not in (".wav", ".npy"):
        raise ValueError(f"{path}: audio clips are .wav files or .npy log-mel arrays")
    return path.suffix[1:]


def sniff(data: bytes, where: str) -> str:
    """``wav`` or ``npy`` from a clip's first bytes (RIFF/WAVE, or numpy's magic string)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:6] == b"\x93NUMPY":
        return "npy"
    raise ValueError(f"{where}: audio clips are .wav (RIFF/WAVE) or .npy log-mel bytes")


def _header_frames(kind: str, src, n_mels: int, where: str) -> int:
    """Frames of a clip from its header alone: a wav's sample count, an npy array's shape."""
    if kind == "npy":
        try:
            major, _ = np.lib.format.read_magic(src)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, _ = read(src)
        except (ValueError, EOFError, SyntaxError) as exc:
            raise ValueError(f"{where}: not a .npy array ({exc})") from None
        return _npy_frames(shape, n_mels, where)
    with _open_wav(src, where) as w:
        if w.getframerate() != SAMPLE_RATE:
            raise ValueError(f"{where}: {w.getframerate()} Hz audio; the audio encoder reads {SAMPLE_RATE} Hz")
        return w.getnframes() // HOP


def _features(kind: str, src, n_mels: int, where: str) -> torch.Tensor:
    if kind == "npy":
        arr = np.load(src, allow_pickle=False)
        _npy_frames(arr.shape, n_mels, where)
        return torch.tensor(arr, dtype=torch.float32)
    return log_mel(read_wav(src, where), n_mels)


def clip_frames(path: str | Path, n_mels: int, max_frames: int) -> int:
    """Frames ``load_clip`` will return for ``path``, from the file's header alone (plan time)."""
    path = Path(path)
    kind = _kind(path)
    if kind == "npy":
        with open(path, "rb") as f:
            return _even(_header_frames(kind, f, n_mels, str(path)), max_frames, str(path))
    return _even(_header_frames(kind, path, n_mels, str(path)), max_frames, str(path))


def clip_frames_bytes(head: bytes, n_mels: int, max_frames: int, where: str) -> int:
    """``clip_frames`` of a clip stored as bytes (a tar member, a parquet cell), from its first
    bytes (``head``: at least the header)."""
    kind = sniff(head, where)
    return _even(_header_frames(kind, io.BytesIO(head), n_mels, where), max_frames, where)


def load_clip(path: str | Path, n_mels: int, max_frames: int) -> torch.Tensor:
    """[n_mels, frames] features of a .wav file or a .npy log-mel array, cut to ``max_frames``
    and to an even frame count (the encoder's stride-2 convolution); ValueError naming the file."""
    path = Path(path)
    feats = _features(_kind(path), path, n_mels, str(path))
    return feats[:, : _even(feats.shape[1], max_frames, str(path))].contiguous()


def load_clip_bytes(data: bytes, n_mels: int, max_frames: int, where: str) -> torch.Tensor:
    """``load_clip`` of a clip stored as bytes (.wav or .npy, told apart by their first bytes)."""
    feats = _features(sniff(data, where), io.BytesIO(data), n_mels, where)
    return feats[:, : _even(feats.shape[1], max_frames, where)].contiguous()

"""Audio clips as the audio encoder reads them: log-mel features [n_mels, frames].

Whisper's front end, written with torch only (no torchaudio): a Hann-windowed STFT with hop
``HOP`` and window ``N_FFT`` at ``SAMPLE_RATE``, power spectrum, a Slaney-style triangular mel
filter bank, ``log10`` clamped to 8 decades below the clip's peak and scaled ``(x + 4) / 4``.
Each frame covers ``HOP`` samples (10 ms at 16 kHz), so a clip of ``f`` frames is ``f * HOP``
samples long; the audio encoder's stride-2 convolution makes ``f // 2`` rows of it.

Sources: ``synthetic_clip`` (seeded tones and noise, any length) and ``load_clip`` (a .wav file
read with the standard ``wave`` module, or a .npy array of log-mel features).
"""

from __future__ import annotations

import functools
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


def read_wav(path: str | Path) -> torch.Tensor:
    """Mono float32 samples in [-1, 1] of a PCM .wav at ``SAMPLE_RATE`` (8/16/32-bit, channels averaged)."""
    with wave.open(str(path), "rb") as w:
        rate, width, channels, n = w.getframerate(), w.getsampwidth(), w.getnchannels(), w.getnframes()
        raw = w.readframes(n)
    if rate != SAMPLE_RATE:
        raise ValueError(f"{path}: {rate} Hz audio; the audio encoder reads {SAMPLE_RATE} Hz (resample it first)")
    if width == 1:
        data = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        kind = np.int16 if width == 2 else np.int32
        data = np.frombuffer(raw, dtype=kind).astype(np.float32) / float(np.iinfo(kind).max + 1)
    else:
        raise ValueError(f"{path}: {8 * width}-bit samples; 8, 16 or 32-bit PCM is read")
    return torch.from_numpy(data.reshape(-1, channels).mean(axis=1).copy())


def clip_frames(path: str | Path, n_mels: int, max_frames: int) -> int:
    """Frames ``load_clip`` will return for ``path``, from the file's header alone (plan time)."""
    path = Path(path)
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        if arr.ndim != 2 or arr.shape[0] != n_mels:
            raise ValueError(f"{path}: log-mel array of shape {arr.shape}; expected ({n_mels}, frames)")
        frames = arr.shape[1]
    elif path.suffix == ".wav":
        with wave.open(str(path), "rb") as w:
            if w.getframerate() != SAMPLE_RATE:
                raise ValueError(f"{path}: {w.getframerate()} Hz audio; the audio encoder reads {SAMPLE_RATE} Hz")
            frames = w.getnframes() // HOP
    else:
        raise ValueError(f"{path}: audio clips are .wav files or .npy log-mel arrays")
    frames = min(frames, max_frames) // 2 * 2
    if frames < 2:
        raise ValueError(f"{path}: shorter than 2 mel frames ({2 * HOP} samples)")
    return frames


def load_clip(path: str | Path, n_mels: int, max_frames: int) -> torch.Tensor:
    """[n_mels, frames] features of a .wav file or a .npy log-mel array, cut to ``max_frames``
    and to an even frame count (the encoder's stride-2 convolution); ValueError naming the file."""
    path = Path(path)
    if path.suffix == ".npy":
        arr = np.load(path, allow_pickle=False)
        if arr.ndim != 2 or arr.shape[0] != n_mels:
            raise ValueError(f"{path}: log-mel array of shape {arr.shape}; expected ({n_mels}, frames)")
        feats = torch.tensor(arr, dtype=torch.float32)
    elif path.suffix == ".wav":
        feats = log_mel(read_wav(path), n_mels)
    else:
        raise ValueError(f"{path}: audio clips are .wav files or .npy log-mel arrays")
    frames = min(feats.shape[1], max_frames) // 2 * 2
    if frames < 2:
        raise ValueError(f"{path}: shorter than 2 mel frames ({2 * HOP} samples)")
    return feats[:, :frames].contiguous()

"""Sizes of the Whisper-style audio encoder (family ``whisper``) and its named presets; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain_ds.models.configs import ProjectorConfig


@dataclass
class AudioEncoderConfig:
    """Audio encoder (family whisper: transformers WhisperEncoder layers) plus its MLP input projector."""

    family: str = "whisper"
    """Model family (whisper): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size this config starts from (tiny | whisper-small | whisper-large-v3); fields given
    beside it override it."""
    n_mels: int = 16
    """Log-mel bins per frame: the input channels of the first convolution (Whisper: 80, large-v3: 128)."""
    hidden_size: int = 32
    """Encoder width (Whisper's ``d_model``); also the width the input projector reads."""
    layers: int = 2
    """Number of transformer layers (``encoder_layers``)."""
    heads: int = 2
    """Attention heads per layer (``encoder_attention_heads``); a TP degree must divide it."""
    ffn_hidden: int = 64
    """MLP inner width (``encoder_ffn_dim``); a TP degree must divide it."""
    max_frames: int = 64
    """Largest clip length in mel frames (Whisper: 3000 = 30 s). The stride-2 convolution halves
    it, giving ``max_frames // 2`` sinusoidal positions (Whisper's ``max_source_positions``); a
    Whisper checkpoint's position table has 1500 rows, so loading one needs 3000 here."""
    frozen: bool = False
    """Keep the encoder's own weights fixed (no weight gradients, no optimizer state); its
    projector follows ``projector.frozen``."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The input projector (encoder width -> LLM width) after the encoder's last layer."""
    checkpoint: str = ""
    """Local weights (.safetensors file or save_pretrained directory) of a transformers
    WhisperEncoder, WhisperModel or WhisperForConditionalGeneration (only the encoder is read);
    empty: seeded random init."""


AUDIO_ENCODER_PRESETS: dict[str, dict] = {
    # Runs a step in well under a second on one CPU core (tests, CPU recipes).
    "tiny": {},
    # openai/whisper-small config.json (transformers WhisperConfig): d_model 768, encoder_layers 12,
    # encoder_attention_heads 12, encoder_ffn_dim 3072, num_mel_bins 80, max_source_positions 1500.
    "whisper-small": dict(n_mels=80, hidden_size=768, layers=12, heads=12, ffn_hidden=3072, max_frames=3000),
    # openai/whisper-large-v3 config.json: d_model 1280, encoder_layers 32, encoder_attention_heads 20,
    # encoder_ffn_dim 5120, num_mel_bins 128, max_source_positions 1500.
    "whisper-large-v3": dict(n_mels=128, hidden_size=1280, layers=32, heads=20, ffn_hidden=5120, max_frames=3000),
}
"""Named sizes (``model.encoder.preset``); each maps config fields to values."""

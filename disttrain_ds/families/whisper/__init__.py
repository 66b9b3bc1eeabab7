"""Whisper-style audio encoder (transformers ``WhisperEncoder`` layers); its MLP input projector is added by the caller.

This record is read by recipe validation, so it imports no torch: the layers and the TP plan
live in ``model.py``. Besides the record, ``modality``, ``width`` and ``rows`` say what the rest
of the system needs to know about the encoder's input and output.
"""

from disttrain_ds.families.base import Family
from disttrain_ds.families.whisper.config import AUDIO_ENCODER_PRESETS, AudioEncoderConfig
from disttrain_ds.families.whisper.estimates import activation_layers, cost_terms, forward_flops_per_clip
from disttrain_ds.families.whisper.hf_settings import whisper_fields

modality = "audio"
"""What the encoder reads: log-mel clips [n_mels, frames], packed by ``model.pack_clips``."""


def width(cfg: AudioEncoderConfig) -> int:
    """Features per output row (what the input projector reads)."""
    return cfg.hidden_size


def rows(cfg: AudioEncoderConfig, frames: int) -> int:
    """Output rows (LLM tokens after the projector) of one clip of ``frames`` mel frames: the
    stride-2 convolution halves an even frame count."""
    return frames // 2


# Prefix of a WhisperEncoder key: none (WhisperEncoder), ``encoder.`` (WhisperModel) or
# ``model.encoder.`` (WhisperForConditionalGeneration); decoder keys match no rule.
_P = r"^(?:(?:model\.)?encoder\.)?"


def _problems(cfg: AudioEncoderConfig, prefix: str) -> list[tuple[str, str]]:
    out = []
    if cfg.hidden_size % cfg.heads:
        out.append((f"{prefix}.heads", f"{cfg.heads} must divide hidden_size {cfg.hidden_size}"))
    if cfg.max_frames % 2:
        out.append((f"{prefix}.max_frames", f"must be even (the stride-2 convolution halves it), got {cfg.max_frames}"))
    return out


FAMILY = Family(
    sliced_tp=True,
    name="whisper",
    role="encoder",
    config_type=AudioEncoderConfig,
    presets=AUDIO_ENCODER_PRESETS,
    model="disttrain_ds.families.whisper.model",
    width=width,
    width_key="hidden_size",
    layer_count=lambda cfg: cfg.layers + 2,  # embed, blocks, head (norm)
    tp_sizes=lambda cfg, prefix, llm_hidden: [
        (f"{prefix}.heads", cfg.heads), (f"{prefix}.ffn_hidden", cfg.ffn_hidden),
    ],
    problems=_problems,
    hf_rules=(
        (_P + r"(conv1|conv2|embed_positions)\.(.*)$", r"embed/\1.\2"),
        (_P + r"layers\.(\d+)\.(.*)$", r"block\1/layer.\2"),
        (_P + r"layer_norm\.(.*)$", r"head/layer_norm.\1"),
    ),
    hf_formats="transformers WhisperEncoder / WhisperModel / WhisperForConditionalGeneration",
    checkpoint_fields=whisper_fields,
    modality=modality,
    item_size=lambda cfg, clip: int(clip.shape[1]),  # log-mel frames
    item_flops=forward_flops_per_clip,
    rows=rows,
    activation_layers=activation_layers,
    cost_terms=cost_terms,
    sp_heads=lambda cfg: (cfg.heads, cfg.heads),
)

__all__ = ["AUDIO_ENCODER_PRESETS", "AudioEncoderConfig", "FAMILY", "modality", "rows", "width"]

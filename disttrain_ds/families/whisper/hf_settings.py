"""What a Whisper checkpoint's ``config.json`` says, as this family's section fields (the encoder's
part); a setting the family does not reproduce is refused in one line naming it. No torch import."""

from __future__ import annotations

from typing import Any

from disttrain_ds.errors import ConfigError

FIELDS = {"d_model": "hidden_size", "encoder_layers": "layers", "encoder_attention_heads": "heads",
          "encoder_ffn_dim": "ffn_hidden", "num_mel_bins": "n_mels", "max_source_positions": "max_frames"}
"""config.json key -> section field (``max_frames`` is twice the positions: the stride-2 convolution)."""

FIXED = {"activation_function": "gelu", "scale_embedding": False, "dropout": 0.0, "attention_dropout": 0.0,
         "activation_dropout": 0.0}
"""Settings the family's layers are built with (dropouts off): a checkpoint that says otherwise is
refused rather than trained as another model."""


def whisper_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Section fields of a Whisper encoder from its checkpoint's ``config.json`` (``where`` names it)."""
    if hf.get("model_type") != "whisper":
        raise ConfigError(f"{where}: 'model_type' is {hf.get('model_type')!r}; this family reads whisper checkpoints")
    for key in FIELDS:
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] < 1:
            raise ConfigError(f"{where}: '{key}' must be a positive integer, got {hf.get(key)!r}")
    for key, value in FIXED.items():
        if hf.get(key, value) != value:
            raise ConfigError(f"{where}: '{key}' is {hf[key]!r}; this family runs Whisper's encoder with {value!r} "
                              "(not reproduced)")
    out = {field: hf[key] for key, field in FIELDS.items()}
    out["max_frames"] = 2 * hf["max_source_positions"]
    return out

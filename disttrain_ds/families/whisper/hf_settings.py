"""What a Whisper checkpoint's ``config.json`` says, as this family's section fields (the encoder's
part); a setting the family does not reproduce is refused in one line naming it. No torch import."""

from __future__ import annotations

from typing import Any

from disttrain_ds.families.hf_config_checks import refuse_other_settings, require_kind, require_positive_ints

FIELDS = {"d_model": "hidden_size", "encoder_layers": "layers", "encoder_attention_heads": "heads",
          "encoder_ffn_dim": "ffn_hidden", "num_mel_bins": "n_mels", "max_source_positions": "max_frames"}
"""config.json key -> section field (``max_frames`` is twice the positions: the stride-2 convolution)."""

FIXED = {"activation_function": "gelu", "scale_embedding": False, "dropout": 0.0, "attention_dropout": 0.0,
         "activation_dropout": 0.0}
"""Settings the family's layers are built with (dropouts off): a checkpoint that says otherwise is
refused rather than trained as another model."""


def whisper_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Section fields of a Whisper encoder from its checkpoint's ``config.json`` (``where`` names it)."""
    require_kind(hf, "model_type", ("whisper",), where)
    require_positive_ints(hf, FIELDS, where)
    refuse_other_settings(hf, FIXED, where, "Whisper's encoder")
    out = {field: hf[key] for key, field in FIELDS.items()}
    out["max_frames"] = 2 * hf["max_source_positions"]
    return out

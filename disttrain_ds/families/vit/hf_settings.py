"""What a ViT checkpoint's ``config.json`` says, as this family's section fields; a setting the
family does not reproduce is refused in one line naming it. No torch import."""

from __future__ import annotations

from typing import Any

from disttrain_ds.errors import ConfigError

FIELDS = {"hidden_size": "hidden_size", "num_hidden_layers": "layers", "num_attention_heads": "heads",
          "intermediate_size": "ffn_hidden", "patch_size": "patch_size", "image_size": "image_size"}
"""config.json key -> section field."""

FIXED = {"hidden_act": "gelu", "qkv_bias": True, "num_channels": 3, "layer_norm_eps": 1e-12,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
"""Settings the family's layers are built with (transformers' ViT defaults, dropouts off): a
checkpoint that says otherwise is refused rather than trained as another model."""


def vit_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Section fields of a ViT encoder from its checkpoint's ``config.json`` (``where`` names it)."""
    if hf.get("model_type") != "vit":
        raise ConfigError(f"{where}: 'model_type' is {hf.get('model_type')!r}; this family reads vit checkpoints")
    for key in FIELDS:
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] < 1:
            raise ConfigError(f"{where}: '{key}' must be a positive integer, got {hf.get(key)!r}")
    for key, value in FIXED.items():
        if hf.get(key, value) != value:
            raise ConfigError(f"{where}: '{key}' is {hf[key]!r}; this family runs ViT with {value!r} (not reproduced)")
    return {field: hf[key] for key, field in FIELDS.items()}

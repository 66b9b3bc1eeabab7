"""What a ViT checkpoint's ``config.json`` says, as this family's section fields; a setting the
family does not reproduce is refused in one line naming it. No torch import."""

from __future__ import annotations

from typing import Any

from disttrain_ds.families.hf_config_checks import refuse_other_settings, require_kind, require_positive_ints

FIELDS = {"hidden_size": "hidden_size", "num_hidden_layers": "layers", "num_attention_heads": "heads",
          "intermediate_size": "ffn_hidden", "patch_size": "patch_size", "image_size": "image_size"}
"""config.json key -> section field."""

FIXED = {"hidden_act": "gelu", "qkv_bias": True, "num_channels": 3, "layer_norm_eps": 1e-12,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
"""Settings the family's layers are built with (transformers' ViT defaults, dropouts off): a
checkpoint that says otherwise is refused rather than trained as another model."""


def vit_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Section fields of a ViT encoder from its checkpoint's ``config.json`` (``where`` names it)."""
    require_kind(hf, "model_type", ("vit",), where)
    require_positive_ints(hf, FIELDS, where)
    refuse_other_settings(hf, FIXED, where, "ViT")
    return {field: hf[key] for key, field in FIELDS.items()}

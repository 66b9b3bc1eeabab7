"""What a diffusers ``PixArtTransformer2DModel`` checkpoint's ``config.json`` says, as this family's
section fields; a setting the family does not build is refused in one line naming it. No torch."""

from __future__ import annotations

from typing import Any

from disttrain_ds.errors import ConfigError
from disttrain_ds.families.hf_config_checks import refuse_other_settings, require_kind, require_positive_ints

FIELDS = {"num_attention_heads": "heads", "attention_head_dim": "head_dim", "num_layers": "layers",
          "cross_attention_dim": "cross_attention_dim", "in_channels": "in_channels", "sample_size": "resolution",
          "patch_size": "patch_size"}
"""config.json key -> section field."""

FIXED: dict[str, Any] = {
    "dropout": 0.0, "norm_num_groups": 32, "attention_bias": True, "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000, "upcast_attention": False, "norm_type": "ada_norm_single",
    "norm_elementwise_affine": False, "norm_eps": 1e-06, "interpolation_scale": None, "attention_type": "default",
}
"""diffusers' defaults (0.42) for the other constructor arguments the family builds with: a
checkpoint that sets one differently is refused rather than trained as another model. The caption
projection (``caption_channels``) is replaced by the module's output projector by design."""


def dit_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Section fields of a DiT generator from its checkpoint's ``config.json`` (``where`` names it)."""
    require_kind(hf, "_class_name", ("PixArtTransformer2DModel",), where)
    require_positive_ints(hf, FIELDS, where)
    refuse_other_settings(hf, FIXED, where, "PixArt")
    extra = hf.get("use_additional_conditions")
    if extra or (extra is None and hf["sample_size"] == 128):  # diffusers turns them on for PixArt 1024
        raise ConfigError(f"{where}: 'use_additional_conditions' is on; the data path has no resolution or "
                          "aspect-ratio conditions (not reproduced)")
    out_channels = hf.get("out_channels", hf["in_channels"])
    if out_channels not in (hf["in_channels"], 2 * hf["in_channels"]):
        raise ConfigError(f"{where}: 'out_channels' is {out_channels}; this family predicts in_channels "
                          f"({hf['in_channels']}) or twice that (learned sigma)")
    out = {field: hf[key] for key, field in FIELDS.items()}
    out["learn_sigma"] = out_channels == 2 * hf["in_channels"]
    return out

"""What a diffusers ``UNet2DConditionModel`` checkpoint's ``config.json`` says, as this family's
section fields; a setting the family does not build is refused in one line naming it. No torch."""

from __future__ import annotations

from typing import Any

from disttrain_ds.errors import ConfigError
from disttrain_ds.families.hf_config_checks import refuse_other_settings, require_kind

FIELDS = {"sample_size": "resolution", "in_channels": "in_channels", "block_out_channels": "block_out_channels",
          "layers_per_block": "layers_per_block", "down_block_types": "down_block_types",
          "up_block_types": "up_block_types", "attention_head_dim": "attention_head_dim",
          "cross_attention_dim": "cross_attention_dim", "norm_num_groups": "norm_num_groups",
          "use_linear_projection": "use_linear_projection", "upcast_attention": "upcast_attention"}
"""config.json key -> section field."""

FIXED: dict[str, Any] = {
    "center_input_sample": False, "flip_sin_to_cos": True, "freq_shift": 0,
    "mid_block_type": "UNetMidBlock2DCrossAttn", "only_cross_attention": False, "downsample_padding": 1,
    "mid_block_scale_factor": 1, "dropout": 0.0, "act_fn": "silu", "norm_eps": 1e-05,
    "transformer_layers_per_block": 1, "reverse_transformer_layers_per_block": None, "encoder_hid_dim": None,
    "encoder_hid_dim_type": None, "num_attention_heads": None, "dual_cross_attention": False,
    "class_embed_type": None, "addition_embed_type": None, "addition_time_embed_dim": None,
    "num_class_embeds": None, "resnet_time_scale_shift": "default", "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0, "time_embedding_type": "positional", "time_embedding_dim": None,
    "time_embedding_act_fn": None, "timestep_post_act": None, "time_cond_proj_dim": None, "conv_in_kernel": 3,
    "conv_out_kernel": 3, "projection_class_embeddings_input_dim": None, "attention_type": "default",
    "class_embeddings_concat": False, "mid_block_only_cross_attention": None, "cross_attention_norm": None,
}
"""diffusers' defaults (0.42) for every other constructor argument: the family builds the U-Net with
them, so a checkpoint that sets one differently is refused rather than trained as another model."""


def unet_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Section fields of a U-Net generator from its checkpoint's ``config.json`` (``where`` names it)."""
    require_kind(hf, "_class_name", ("UNet2DConditionModel",), where)
    if hf.get("out_channels", hf.get("in_channels")) != hf.get("in_channels"):
        raise ConfigError(f"{where}: 'out_channels' {hf.get('out_channels')} differs from in_channels "
                          f"{hf.get('in_channels')}; the generator predicts noise of its input's shape")
    refuse_other_settings(hf, FIXED, where, "the U-Net")
    missing = [k for k in FIELDS if k not in hf and k != "upcast_attention"]
    if missing:
        raise ConfigError(f"{where}: '{missing[0]}' is missing")
    out = {field: hf[key] for key, field in FIELDS.items() if key in hf}
    heads = out["attention_head_dim"]
    if isinstance(heads, int):  # one value for every level
        out["attention_head_dim"] = [heads] * len(out["block_out_channels"])
    return out

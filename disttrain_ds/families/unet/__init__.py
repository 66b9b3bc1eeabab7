"""Diffusion U-Net generator (diffusers ``UNet2DConditionModel`` split by block) with its MLP output projector."""

from ...models.configs import GENERATOR_PRESETS, GeneratorConfig
from ..base import Family


def _tp_sizes(cfg: GeneratorConfig, prefix: str, llm_hidden: int) -> list[tuple[str, int]]:
    # ``attention_head_dim`` holds head counts (diffusers' naming).
    return [(f"{prefix}.attention_head_dim[{i}]", h) for i, h in enumerate(cfg.attention_head_dim)]


FAMILY = Family(
    name="unet",
    role="generator",
    config_type=GeneratorConfig,
    presets=GENERATOR_PRESETS,
    model="disttrain_ds.families.unet.model",
    # U-Net in, downs, mid, ups, out
    width=lambda cfg: cfg.cross_attention_dim,
    width_key="cross_attention_dim",
    layer_count=lambda cfg: 1 + len(cfg.down_block_types) + 1 + len(cfg.up_block_types) + 1,
    tp_sizes=_tp_sizes,
    hf_rules=(
        (r"^(conv_in|time_embedding)\.(.*)$", r"unet_in/\1.\2"),
        (r"^down_blocks\.(\d+)\.(.*)$", r"down\1/block.\2"),
        (r"^mid_block\.(.*)$", r"mid/block.\1"),
        (r"^up_blocks\.(\d+)\.(.*)$", r"up\1/block.\2"),
        (r"^(conv_norm_out|conv_out)\.(.*)$", r"unet_out/\1.\2"),
    ),
    hf_formats="diffusers UNet2DConditionModel",
)

"""Diffusion U-Net generator (diffusers ``UNet2DConditionModel`` split by block) with its MLP output projector."""

from disttrain_ds.families.base import Family
from disttrain_ds.families.unet.config import GENERATOR_PRESETS, GeneratorConfig
from disttrain_ds.families.unet.estimates import activation_layers, cost_terms, image_flops
from disttrain_ds.families.unet.hf_settings import unet_fields


def _tp_sizes(cfg: GeneratorConfig, prefix: str, llm_hidden: int) -> list[tuple[str, int]]:
    # ``attention_head_dim`` holds head counts (diffusers' naming); the ResNets split their channels
    # and their second GroupNorm's groups.
    return [*((f"{prefix}.attention_head_dim[{i}]", h) for i, h in enumerate(cfg.attention_head_dim)),
            *((f"{prefix}.block_out_channels[{i}]", c) for i, c in enumerate(cfg.block_out_channels)),
            (f"{prefix}.norm_num_groups", cfg.norm_num_groups)]


def attention_tokens(cfg: GeneratorConfig) -> int:
    """Tokens of one image at the U-Net's smallest level, where its mid block attends: every level's
    token count is a multiple of it, so a TP degree that divides it splits every transformer's rows."""
    return (cfg.resolution // 2 ** (len(cfg.block_out_channels) - 1)) ** 2


def _problems(g: GeneratorConfig, prefix: str) -> list[tuple[str, str]]:
    levels, out = len(g.block_out_channels), []
    if levels < 1 or min(g.block_out_channels) < 1:
        return [(f"{prefix}.block_out_channels", f"must be one or more positive channel counts, got {g.block_out_channels}")]
    for f in ("down_block_types", "up_block_types", "attention_head_dim"):
        if len(getattr(g, f)) != levels:
            out.append((f"{prefix}.{f}", f"needs one entry per block_out_channels level ({levels}), got {len(getattr(g, f))}"))
    if out:
        return out
    if min(g.attention_head_dim) < 1:
        out.append((f"{prefix}.attention_head_dim", "entries must be >= 1"))
    if any(c % g.norm_num_groups for c in g.block_out_channels):
        out.append((f"{prefix}.norm_num_groups",
                    f"{g.norm_num_groups} must divide every block_out_channels entry {g.block_out_channels}"))
    if g.resolution % 2 ** (levels - 1):
        out.append((f"{prefix}.resolution",
                    f"{g.resolution} must be divisible by {2 ** (levels - 1)} (halved once per level after the first)"))
    return out


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
    problems=_problems,
    hf_rules=(
        (r"^(conv_in|time_embedding)\.(.*)$", r"unet_in/\1.\2"),
        (r"^down_blocks\.(\d+)\.(.*)$", r"down\1/block.\2"),
        (r"^mid_block\.(.*)$", r"mid/block.\1"),
        (r"^up_blocks\.(\d+)\.(.*)$", r"up\1/block.\2"),
        (r"^(conv_norm_out|conv_out)\.(.*)$", r"unet_out/\1.\2"),
    ),
    hf_formats="diffusers UNet2DConditionModel",
    checkpoint_fields=unet_fields,
    image_flops=image_flops,
    activation_layers=activation_layers,
    cost_terms=cost_terms,
    channels_last=True,
    sliced_tp=True,
    image_tokens=attention_tokens,
)

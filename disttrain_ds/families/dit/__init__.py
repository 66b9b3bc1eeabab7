"""Diffusion transformer generator (diffusers ``PixArtTransformer2DModel``, PixArt-alpha style, split
by block) after its MLP output projector. Light record: no torch here (recipe validation reads it)."""

from __future__ import annotations

from disttrain_ds.families.base import Family
from disttrain_ds.families.dit.config import DIT_PRESETS, DiTConfig
from disttrain_ds.families.dit.estimates import activation_layers, cost_terms, forward_flops, image_flops, tokens
from disttrain_ds.families.dit.hf_settings import dit_fields


def width(cfg: DiTConfig) -> int:
    """Conditioning width: what the output projector produces and the blocks' cross-attention reads."""
    return cfg.cross_attention_dim


def layer_count(cfg: DiTConfig) -> int:
    """dit_in, one layer per transformer block, dit_out."""
    return cfg.layers + 2


def _tp_sizes(cfg: DiTConfig, prefix: str, llm_hidden: int) -> list[tuple[str, int]]:
    # Attention splits by head; the MLP's 4 x width and the projector's width (checked apart,
    # through ``width_key``) then split too whenever the heads do.
    return [(f"{prefix}.heads", cfg.heads)]


def shape_problems(cfg: DiTConfig, prefix: str) -> list[tuple[str, str]]:
    """(recipe key, message) for each size rule the config breaks (for recipe validation)."""
    problems = []
    if cfg.resolution % cfg.patch_size:
        problems.append((f"{prefix}.resolution", f"{cfg.resolution} must be divisible by patch_size {cfg.patch_size}"))
    return problems


HF_RULES: tuple[tuple[str, str], ...] = (
    (r"^(pos_embed|adaln_single)\.(.*)$", r"dit_in/\1.\2"),
    (r"^transformer_blocks\.(\d+)\.(.*)$", r"block\1/block.\2"),
    (r"^(scale_shift_table)$", r"dit_out/\1"),
    (r"^(norm_out|proj_out)\.(.*)$", r"dit_out/\1.\2"),
    # ``caption_projection.*`` (T5 features -> width) has no place: the output projector replaces it.
)
"""diffusers PixArtTransformer2DModel state-dict keys -> ``layer/param`` of ``model.dit_layers``."""

FAMILY = Family(
    name="dit",
    role="generator",
    config_type=DiTConfig,
    presets=DIT_PRESETS,
    model="disttrain_ds.families.dit.model",
    width=width,
    width_key="cross_attention_dim",
    layer_count=layer_count,
    tp_sizes=_tp_sizes,
    problems=shape_problems,
    hf_rules=HF_RULES,
    hf_formats="diffusers PixArtTransformer2DModel",
    checkpoint_fields=dit_fields,
    image_flops=image_flops,
    activation_layers=activation_layers,
    cost_terms=cost_terms,
    sliced_tp=True,
    image_tokens=tokens,
)

__all__ = ["DIT_PRESETS", "DiTConfig", "FAMILY", "HF_RULES", "activation_layers", "cost_terms", "forward_flops", "image_flops",
           "layer_count", "shape_problems", "width"]

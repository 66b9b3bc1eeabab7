"""CLIP vision tower (transformers ``CLIPVisionModel`` layers, as LLaVA uses it) with its MLP input projector.

The features are the tower's hidden states after ``feature_layer`` (default -2, LLaVA's), CLS
dropped; the layers after it are neither built nor read. The record imports no torch.
"""

from disttrain_ds.families.base import Family
from disttrain_ds.families.clip.config import CLIP_PRESETS, VisionTowerConfig, feature_problem, run_layers
from disttrain_ds.families.clip.estimates import tower_activations, tower_cost_terms, tower_item_flops
from disttrain_ds.families.clip.hf_settings import clip_fields
from disttrain_ds.families.vit.estimates import patches, rows


def tower_problems(cfg: VisionTowerConfig, prefix: str) -> list[tuple[str, str]]:
    """Size rules of a CLIP-shaped tower."""
    out = []
    if cfg.hidden_size % cfg.heads:
        out.append((f"{prefix}.heads", f"{cfg.heads} must divide hidden_size {cfg.hidden_size}"))
    bad = feature_problem(cfg)
    if bad:
        out.append((f"{prefix}.feature_layer", bad))
    if not cfg.layer_norm_eps > 0:
        out.append((f"{prefix}.layer_norm_eps", f"must be > 0, got {cfg.layer_norm_eps}"))
    return out


def tower_tp_sizes(cfg: VisionTowerConfig, prefix: str, llm_hidden: int) -> list[tuple[str, int]]:
    return [(f"{prefix}.heads", cfg.heads), (f"{prefix}.ffn_hidden", cfg.ffn_hidden)]


def tower_rules(prefix: str) -> tuple[tuple[str, str], ...]:
    """Key map of a vision tower: a vision model's keys, or the ``vision_model.`` ones of a whole
    two-tower model (its text tower and projections match no rule); layers past the feature layer
    map to blocks the module does not have and are not read."""
    p = rf"^(?:{prefix}\.)?"
    return (
        (p + r"embeddings\.(.*)$", r"embed/embeddings.\1"),
        (p + r"pre_layrnorm\.(.*)$", r"embed/pre_norm.\1"),
        (p + r"encoder\.layers\.(\d+)\.(.*)$", r"block\1/layer.\2"),
        (p + r"post_layernorm\.(.*)$", r"head/post_layernorm.\1"),
    )


def tower_family(name: str, presets: dict[str, dict], formats: str, checkpoint_fields, cls_token: bool) -> Family:
    """The record of a CLIP-shaped vision tower family (its layers in ``families/<name>/model.py``)."""
    return Family(
        name=name,
        role="encoder",
        sliced_tp=True,
        modality="image",
        config_type=VisionTowerConfig,
        presets=presets,
        model=f"disttrain_ds.families.{name}.model",
        width=lambda cfg: cfg.hidden_size,
        width_key="hidden_size",
        layer_count=lambda cfg: run_layers(cfg) + 2,  # embed, the layers run, head
        blocks=run_layers,
        tp_sizes=tower_tp_sizes,
        problems=tower_problems,
        hf_rules=tower_rules("vision_model"),
        hf_formats=formats,
        checkpoint_fields=checkpoint_fields,
        activation_layers=tower_activations,
        cost_terms=lambda cfg: tower_cost_terms(cfg, cls_token),
        item_size=patches,
        item_flops=lambda cfg, n: tower_item_flops(cfg, n, cls_token),
        rows=rows,
        sp_heads=lambda cfg: (cfg.heads, cfg.heads),
        signed=("feature_layer",),  # -2: the layer before the last
    )


FAMILY = tower_family("clip", CLIP_PRESETS, "transformers CLIPVisionModel or CLIPModel", clip_fields, cls_token=True)

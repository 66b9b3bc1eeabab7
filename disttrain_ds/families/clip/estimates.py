"""CLIP / SigLIP tower activation bytes and FLOPs: the ViT family's formulas over the layers run."""

from __future__ import annotations

import dataclasses

from disttrain_ds.cost.activations import LayerBytes, SampleShape
from disttrain_ds.families.clip.config import VisionTowerConfig, run_layers
from disttrain_ds.families.vit.estimates import cost_terms, encoder_activations, item_flops


def tower_activations(cfg: VisionTowerConfig, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Per-sample activation bytes of embed, the blocks run, head and projector (the ViT shapes:
    pre-norm transformer layers over patches plus one CLS token per image, an upper bound for SigLIP)."""
    return encoder_activations(dataclasses.replace(cfg, layers=run_layers(cfg)), llm_hidden, shape, b)


def tower_cost_terms(cfg: VisionTowerConfig, cls_token: bool) -> dict[str, float]:
    """``CostModel`` encoder coefficients of one image through the blocks run."""
    return cost_terms(cfg, run_layers(cfg), cls_token)


def tower_item_flops(cfg: VisionTowerConfig, patches: int, cls_token: bool) -> float:
    """Forward FLOPs of one image of ``patches`` patches through the blocks run."""
    return item_flops(cfg, patches, run_layers(cfg), cls_token)

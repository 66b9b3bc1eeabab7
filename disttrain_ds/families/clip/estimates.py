"""CLIP / SigLIP tower activation bytes and FLOPs: the ViT family's formulas over the layers run."""

from __future__ import annotations

import dataclasses

from disttrain_ds.cost.activations import LayerBytes, SampleShape
from disttrain_ds.families.clip.config import VisionTowerConfig, run_layers
from disttrain_ds.families.vit.estimates import encoder_activations


def tower_activations(cfg: VisionTowerConfig, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Per-sample activation bytes of embed, the blocks run, head and projector (the ViT shapes:
    pre-norm transformer layers over patches plus one CLS token per image, an upper bound for SigLIP)."""
    return encoder_activations(dataclasses.replace(cfg, layers=run_layers(cfg)), llm_hidden, shape, b)

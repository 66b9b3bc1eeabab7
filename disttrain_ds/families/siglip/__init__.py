"""SigLIP vision tower (transformers ``SiglipVisionModel`` layers) with its MLP input projector.

The CLIP family's code over SigLIP's classes: no CLS token, no pre-LayerNorm; its attention-pooling
head is not part of the features and is neither built nor read (export writes the tower without it).
"""

from disttrain_ds.families.base import Family
from disttrain_ds.families.clip import tower_problems, tower_rules, tower_tp_sizes
from disttrain_ds.families.clip.config import SIGLIP_PRESETS, VisionTowerConfig, run_layers
from disttrain_ds.families.clip.estimates import tower_activations
from disttrain_ds.families.clip.hf_settings import tower_fields

FAMILY = Family(
    name="siglip",
    role="encoder",
    modality="image",
    config_type=VisionTowerConfig,
    presets=SIGLIP_PRESETS,
    model="disttrain_ds.families.siglip.model",
    width=lambda cfg: cfg.hidden_size,
    width_key="hidden_size",
    layer_count=lambda cfg: run_layers(cfg) + 2,  # embed, the layers run, head
    blocks=run_layers,
    tp_sizes=tower_tp_sizes,
    problems=tower_problems,
    hf_rules=tower_rules("vision_model"),
    hf_formats="transformers SiglipVisionModel or SiglipModel",
    checkpoint_fields=lambda hf, where: tower_fields(hf, where, "siglip_vision_model", "siglip", 1e-6,
                                                     "gelu_pytorch_tanh"),
    activation_layers=tower_activations,
    cls_token=False,
    signed=("feature_layer",),  # -2: the layer before the last
)

"""SigLIP vision tower (transformers ``SiglipVisionModel`` layers) with its MLP input projector.

The CLIP family's code over SigLIP's classes: no CLS token, no pre-LayerNorm; its attention-pooling
head is not part of the features and is neither built nor read (export writes the tower without it).
"""

from disttrain_ds.families.clip import tower_family
from disttrain_ds.families.clip.config import SIGLIP_PRESETS
from disttrain_ds.families.clip.hf_settings import tower_fields

FAMILY = tower_family(
    "siglip", SIGLIP_PRESETS, "transformers SiglipVisionModel or SiglipModel",
    lambda hf, where: tower_fields(hf, where, "siglip_vision_model", "siglip", 1e-6, "gelu_pytorch_tanh"),
    cls_token=False,
)

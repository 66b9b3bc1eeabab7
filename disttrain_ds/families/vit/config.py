"""The ViT image encoder's section (family ``vit``) and its named presets; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain_ds.models.configs import ProjectorConfig


@dataclass
class EncoderConfig:
    """Image encoder (family vit: transformers ViTModel layers) plus its MLP input projector."""

    family: str = "vit"
    """Model family (vit): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size this config starts from (tiny | vit-h-14); fields given beside it override it."""
    hidden_size: int = 32
    """ViT width."""
    layers: int = 2
    """Number of ViT transformer layers."""
    heads: int = 2
    """Attention heads per layer."""
    ffn_hidden: int = 64
    """ViT MLP inner width."""
    patch_size: int = 8
    """Square patch side in pixels; one patch becomes one LLM token."""
    image_size: int = 32
    """Side of the position-embedding grid in pixels; other resolutions are interpolated."""
    frozen: bool = False
    """Keep the encoder's own weights fixed (no weight gradients, no optimizer state); its
    projector follows ``projector.frozen``."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The input projector (encoder width -> LLM width) after the encoder's last layer."""
    checkpoint: str = ""
    """Local ViT weights (.safetensors file or save_pretrained directory); empty: seeded random init."""


ENCODER_PRESETS: dict[str, dict] = {
    "tiny": {},
    # google/vit-huge-patch14-224-in21k: 32 layers, width 1280, 16 heads, MLP 5120.
    "vit-h-14": dict(hidden_size=1280, layers=32, heads=16, ffn_hidden=5120, patch_size=14, image_size=224),
}

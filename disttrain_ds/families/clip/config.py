"""Sizes of a CLIP / SigLIP vision tower used as an image encoder (families ``clip``, ``siglip``)
and their named presets; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from disttrain_ds.models.configs import ProjectorConfig

Activation = Literal["quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
"""MLP activations a tower may use, as transformers names them (it computes each)."""


@dataclass
class VisionTowerConfig:
    """Image encoder from a CLIP or SigLIP vision tower (transformers ``CLIPVisionModel`` /
    ``SiglipVisionModel`` layers) plus its MLP input projector. Its patch features are the tower's
    hidden states after layer ``feature_layer`` (LLaVA's choice), CLS dropped."""

    family: str = "clip"
    """Model family (clip | siglip): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size this config starts from (clip: tiny | clip-vit-l-14-336; siglip: tiny |
    siglip-so400m-14-384); fields given beside it override it."""
    hidden_size: int = 32
    """Tower width; also the width the input projector reads."""
    layers: int = 3
    """Transformer layers of the tower (``num_hidden_layers``); the module runs those up to
    ``feature_layer`` and builds no later one."""
    heads: int = 2
    """Attention heads per layer; a TP degree must divide it."""
    ffn_hidden: int = 64
    """MLP inner width (``intermediate_size``); a TP degree must divide it."""
    patch_size: int = 8
    """Square patch side in pixels; one patch becomes one LLM token."""
    image_size: int = 32
    """Side of the position-embedding grid in pixels; other resolutions are interpolated (bicubic,
    as transformers does with ``interpolate_pos_encoding``)."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (CLIP 1e-5, SigLIP 1e-6)."""
    hidden_act: Activation = "quick_gelu"
    """MLP activation as transformers names it (OpenAI CLIP: quick_gelu; SigLIP: gelu_pytorch_tanh)."""
    feature_layer: int = -2
    """Whose hidden states become the patch features, indexed as transformers' ``hidden_states``
    (0: the embeddings, k: layer k's output): -1 the last layer's, -2 the one before (LLaVA's
    ``vision_feature_layer``). Neither tower's final LayerNorm is applied (LLaVA reads the hidden
    states as they are)."""
    frozen: bool = False
    """Keep the tower's own weights fixed (no weight gradients, no optimizer state); its
    projector follows ``projector.frozen``."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The input projector (tower width -> LLM width) after the tower's last layer run."""
    checkpoint: str = ""
    """Local weights (.safetensors file or save_pretrained directory) of a transformers
    CLIPVisionModel / CLIPModel (SiglipVisionModel / SiglipModel); only the vision tower is read.
    Empty: seeded random init."""


def run_layers(cfg: VisionTowerConfig) -> int:
    """Transformer layers the module builds and runs: up to and including ``feature_layer``."""
    return cfg.layers + 1 + cfg.feature_layer if cfg.feature_layer < 0 else cfg.feature_layer


def feature_problem(cfg: VisionTowerConfig) -> str | None:
    """Why ``feature_layer`` names no layer of the tower, or None."""
    if not 1 <= run_layers(cfg) <= cfg.layers:
        return (f"{cfg.feature_layer} names no layer of a {cfg.layers}-layer tower "
                f"(-{cfg.layers} .. -1 or 1 .. {cfg.layers})")
    return None


CLIP_PRESETS: dict[str, dict] = {
    "tiny": {},
    # openai/clip-vit-large-patch14-336 vision_config (LLaVA-1.5's tower).
    "clip-vit-l-14-336": dict(hidden_size=1024, layers=24, heads=16, ffn_hidden=4096, patch_size=14, image_size=336),
}
"""Named sizes of the ``clip`` family."""

SIGLIP_PRESETS: dict[str, dict] = {
    "tiny": dict(layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh"),
    # google/siglip-so400m-patch14-384 vision_config.
    "siglip-so400m-14-384": dict(hidden_size=1152, layers=27, heads=16, ffn_hidden=4304, patch_size=14,
                                 image_size=384, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh"),
}
"""Named sizes of the ``siglip`` family."""

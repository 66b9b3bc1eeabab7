"""SigLIP layers: the CLIP family's tower layers built from transformers' SigLIP classes."""

from __future__ import annotations

from transformers import SiglipVisionConfig, SiglipVisionModel
from transformers.models.siglip.modeling_siglip import SiglipAttention, SiglipMLP

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.clip import model as clip_model
from disttrain_ds.families.clip.config import VisionTowerConfig
from disttrain_ds.families.clip.model import Tower, tower_layers, tower_model
from disttrain_ds.models.layers import LayerDef


def siglip_config(cfg: VisionTowerConfig, layers: int) -> SiglipVisionConfig:
    return SiglipVisionConfig(hidden_size=cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=cfg.heads,
                              intermediate_size=cfg.ffn_hidden, patch_size=cfg.patch_size, image_size=cfg.image_size,
                              layer_norm_eps=cfg.layer_norm_eps, hidden_act=cfg.hidden_act, attention_dropout=0.0,
                              vision_use_head=False, attn_implementation="sdpa")


SIGLIP = Tower(siglip_config, SiglipVisionModel, cls=False)


def layers(cfg: VisionTowerConfig, ctx: BuildContext) -> list[LayerDef]:
    return tower_layers(cfg, ctx, SIGLIP)


def hf_model(cfg: VisionTowerConfig) -> SiglipVisionModel:
    return tower_model(cfg, SIGLIP)


def clear_caches() -> None:
    clip_model.clear_caches()  # the towers' build cache lives in the CLIP module


TP_PLAN = (
    (SiglipAttention, {"q_proj": "col", "k_proj": "col", "v_proj": "col", "out_proj": "row"}),
    (SiglipMLP, {"fc1": "col", "fc2": "row"}),
)

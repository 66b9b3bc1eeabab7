"""A CLIP-style vision tower as pipeline layers: embeddings (+ CLIP's pre-LayerNorm), the tower's
layers up to the feature layer, and a head that drops CLS (the projector follows).

Written for CLIP; SigLIP's tower (no CLS, no pre-LayerNorm) reuses it through its own ``Tower``
(``families/siglip``). Images of different resolutions travel packed as in the ViT family
(``hidden`` [tokens of all images, width] and one count per image), each layer running the images of
one token count together as a batch. The tower's final LayerNorm is not part of the features (LLaVA
reads the hidden states as they are); the head keeps it, frozen, so that export writes a whole model.

Under sequence parallelism (``seq_parallel``, set by ``parallel/sequence_parallel.py::attach``) the
embedding keeps this rank's slice of the packed rows, each block attends through the exchange of
``models/packed_sp.py``, and the head gathers the rows back. Under tensor parallelism on sequence
slices (``tp_seq``, ``parallel/tp_sequence.py::attach``) likewise, each block running
``sharded.tower_layer`` (``models/packed_tp.py``: collectives overlapped with its GEMMs).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, PretrainedConfig
from transformers.models.clip.modeling_clip import CLIPMLP, CLIPAttention

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.clip.config import VisionTowerConfig, run_layers
from disttrain_ds.families.clip.sharded import tower_layer
from disttrain_ds.models.layers import LayerDef, SlicedLayer, layer_seed, seeded
from disttrain_ds.models.packed_sp import gather_rows, shard_rows, sp_layer
from disttrain_ds.models.packed_tp import on_items, on_slices
from disttrain_ds.models.pixels import embed_by_size


@dataclass(frozen=True)
class Tower:
    """What one CLIP-shaped vision tower family is built from."""

    config: Callable[[VisionTowerConfig, int], PretrainedConfig]
    """(our config, tower layers) -> the family's transformers vision config."""
    model: Callable[[PretrainedConfig], nn.Module]
    """transformers vision config -> the whole vision model (random init)."""
    cls: bool
    """The embeddings put a CLS token before each image's patches (dropped from the features)."""
    pre_norm: str = ""
    """Attribute of a LayerNorm the tower applies right after its embeddings (CLIP's ``pre_layrnorm``)."""


def clip_config(cfg: VisionTowerConfig, layers: int) -> CLIPVisionConfig:
    return CLIPVisionConfig(hidden_size=cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=cfg.heads,
                            intermediate_size=cfg.ffn_hidden, patch_size=cfg.patch_size, image_size=cfg.image_size,
                            layer_norm_eps=cfg.layer_norm_eps, hidden_act=cfg.hidden_act, attention_dropout=0.0,
                            attn_implementation="sdpa")


CLIP = Tower(clip_config, CLIPVisionModel, cls=True, pre_norm="pre_layrnorm")


def tower_model(cfg: VisionTowerConfig, tower: Tower) -> nn.Module:
    """The whole transformers model of the layers this module runs (what export writes): its
    ``num_hidden_layers`` is the layers run, so its last hidden state is the features
    (``feature_layer: -1`` in its config.json, read back on import)."""
    model = tower.model(tower.config(cfg, run_layers(cfg)))
    model.config.feature_layer = -1
    return model


def _cache_key(cfg: VisionTowerConfig) -> str:
    return json.dumps({k: v for k, v in cfg.__dict__.items() if k != "projector"}, sort_keys=True)


@functools.lru_cache(maxsize=4)
def _full(cfg_json: str, seed: int, tower: Tower) -> nn.Module:
    """The whole tower (layers run only), built once per process with the library's own init."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tower_model(VisionTowerConfig(**json.loads(cfg_json)), tower)


class TowerEmbed(nn.Module):
    """(pixels, hw) -> (hidden, counts): patch and position embeddings (and CLS) per image, then
    the tower's pre-LayerNorm if it has one."""

    def __init__(self, embeddings: nn.Module, pre_norm: nn.Module | None):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.embeddings, self.pre_norm = embeddings, pre_norm

    def compile_targets(self) -> list[nn.Module]:
        return []  # one call per image size, grouped on the host

    def forward(self, inputs):
        flat, hw = inputs
        hidden, counts = embed_by_size(lambda x: self.embeddings(x, interpolate_pos_encoding=True), flat, hw,
                                       self.embeddings.patch_embedding.out_channels)
        if self.pre_norm is not None:
            hidden = self.pre_norm(hidden)
        if self.seq_parallel is not None:
            hidden = shard_rows(hidden, self.seq_parallel)
        if self.tp_seq is not None:
            hidden = self.tp_seq.scatter_packed(hidden)
        return hidden, counts


class TowerBlock(nn.Module):
    """(hidden, counts) -> (hidden, counts): one tower layer, attention within each image."""

    tp_seq_region = True  # on slices: replicated weights' gradients summed over TP
    packed_items = True  # its written-out forward attends packed items: flex warmed up before step 1

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.layer = layer
        object.__setattr__(self, "sliced", SlicedLayer(self.layer, tower_layer))  # unregistered: no new names

    def compile_targets(self) -> list[nn.Module]:
        # Items grouped by length on the host, outside the graph; on slices the collectives run
        # between the layer's modules, and items of mixed lengths on CUDA attend in one call
        # between them, so the written-out forward is compiled there (``on_items``).
        return [self.sliced] if self.tp_seq is not None else [self.layer, self.sliced]

    def forward(self, inputs):
        hidden, counts = inputs
        if self.seq_parallel is not None:
            return sp_layer(self.layer, hidden, counts, self.seq_parallel), counts
        if self.tp_seq is not None:
            return on_slices(self.sliced, hidden, counts, self.tp_seq), counts
        return on_items(self.sliced, lambda x: self.layer(x, attention_mask=None), hidden, counts), counts


class TowerHead(nn.Module):
    """(hidden, counts) -> patch features [patches, width]: CLS rows dropped. Holds the tower's
    final LayerNorm frozen and unused (LLaVA's features skip it; export writes it back)."""

    def __init__(self, post_layernorm: nn.Module, cls: bool):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.post_layernorm, self.cls = post_layernorm.requires_grad_(False), cls

    def compile_targets(self) -> list[nn.Module]:
        return []  # no compute: CLS rows dropped by a data-dependent index

    def forward(self, inputs):
        hidden, counts = inputs
        if self.seq_parallel is not None:
            hidden = gather_rows(hidden, int(counts.sum()), self.seq_parallel)
        if self.tp_seq is not None:
            hidden = self.tp_seq.gather_packed(hidden, counts)
        if not self.cls:
            return hidden
        keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        keep[torch.cumsum(counts, 0) - counts] = False  # CLS rows
        return hidden[keep]


def tower_layers(cfg: VisionTowerConfig, ctx: BuildContext, tower: Tower) -> list[LayerDef]:
    """Ordered pipeline layers: embed, one block per layer run, head."""
    seed, module = ctx.seed, ctx.module
    init = layer_seed(seed, module, "init")  # two towers of one size start apart

    def part(pick):
        return copy.deepcopy(pick(_full(_cache_key(cfg), init, tower)))  # a private copy; the cache never trains

    def embed() -> TowerEmbed:
        return TowerEmbed(part(lambda m: m.embeddings), part(lambda m: getattr(m, tower.pre_norm)) if tower.pre_norm else None)

    defs = [seeded(seed, module, "embed", embed)]
    for i in range(run_layers(cfg)):
        defs.append(seeded(seed, module, f"block{i}", lambda i=i: TowerBlock(part(lambda m: m.encoder.layers[i]))))
    defs.append(seeded(seed, module, "head", lambda: TowerHead(part(lambda m: m.post_layernorm), tower.cls)))
    return defs


def layers(cfg: VisionTowerConfig, ctx: BuildContext) -> list[LayerDef]:
    return tower_layers(cfg, ctx, CLIP)


def hf_model(cfg: VisionTowerConfig) -> CLIPVisionModel:
    return tower_model(cfg, CLIP)


def clear_caches() -> None:
    _full.cache_clear()


TP_PLAN = (
    (CLIPAttention, {"q_proj": "col", "k_proj": "col", "v_proj": "col", "out_proj": "row"}),
    (CLIPMLP, {"fc1": "col", "fc2": "row"}),
)

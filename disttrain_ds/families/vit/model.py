"""Image encoder as pipeline layers: ViT embeddings, ViT blocks, final norm (the projector follows).

Images of different resolutions give different numbers of patches, so activations travel packed:
``hidden`` is [sum of tokens over images, width] and ``counts`` (int64, one entry per image) says
how many rows belong to each image. Attention must stay within an image, so each block runs the
images of equal token count together as one batch (no padding, no mask, exact).

Under sequence parallelism (``seq_parallel``, set by ``parallel/sequence_parallel.py::attach``) the
embedding keeps this rank's slice of the packed rows, each block attends through the exchange of
``models/packed_sp.py``, and the head gathers the rows back before its norm. Under tensor
parallelism on sequence slices (``tp_seq``, ``parallel/tp_sequence.py::attach``) likewise: the
embedding keeps this rank's slice, each block runs ``sharded.vit_layer`` (``models/packed_tp.py``:
collectives overlapped with its GEMMs), and the head gathers the rows back.
"""

from __future__ import annotations

import copy
import functools
import json

import torch
from torch import nn
from transformers import ViTConfig, ViTModel
from transformers.models.vit.modeling_vit import ViTAttention, ViTMLP

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.vit.config import EncoderConfig
from disttrain_ds.families.vit.sharded import vit_layer
from disttrain_ds.models.layers import LayerDef, SlicedLayer, layer_seed, seeded
from disttrain_ds.models.packed_sp import gather_rows, shard_rows, sp_layer
from disttrain_ds.models.packed_tp import on_items, on_slices
from disttrain_ds.models.pixels import embed_by_size


def hf_config(cfg: EncoderConfig) -> ViTConfig:
    return ViTConfig(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        intermediate_size=cfg.ffn_hidden,
        patch_size=cfg.patch_size,
        image_size=cfg.image_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )


def hf_model(cfg: EncoderConfig) -> ViTModel:
    """The whole transformers model this family's layers are cut from (what export writes)."""
    return ViTModel(hf_config(cfg), add_pooling_layer=False)


def _cache_key(cfg) -> str:
    """The config's own fields as JSON (the projector is not part of this network)."""
    return json.dumps({k: v for k, v in cfg.__dict__.items() if k != "projector"}, sort_keys=True)


@functools.lru_cache(maxsize=4)
def _full_vit(cfg_json: str, seed: int) -> ViTModel:
    """The whole HF ViT, built once per process with HF's own init; layers are taken from it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return hf_model(EncoderConfig(**json.loads(cfg_json)))


def _vit_part(cfg: EncoderConfig, seed: int, pick):
    """A private copy of one part of the cached initial ViT (the cache itself is never trained)."""
    return copy.deepcopy(pick(_full_vit(_cache_key(cfg), seed)))


class VitEmbed(nn.Module):
    """(pixels, hw) -> (hidden, counts): patch + position embeddings and the CLS token per image."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.embeddings = embeddings

    def compile_targets(self) -> list[nn.Module]:
        return []  # one call per image size, grouped on the host

    def forward(self, inputs):
        flat, hw = inputs
        hidden, counts = embed_by_size(lambda x: self.embeddings(x, interpolate_pos_encoding=True), flat, hw,
                                       self.embeddings.cls_token.shape[-1])
        if self.seq_parallel is not None:
            hidden = shard_rows(hidden, self.seq_parallel)
        if self.tp_seq is not None:
            hidden = self.tp_seq.scatter_packed(hidden)
        return hidden, counts


class VitBlock(nn.Module):
    """(hidden, counts) -> (hidden, counts): one ViT transformer layer, attention per image."""

    tp_seq_region = True  # on slices: replicated weights' gradients summed over TP
    packed_items = True  # its written-out forward attends packed items: flex warmed up before step 1

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.layer = layer
        object.__setattr__(self, "sliced", SlicedLayer(self.layer, vit_layer))  # unregistered: no new names

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
        return on_items(self.sliced, self.layer, hidden, counts), counts


class VitHead(nn.Module):
    """(hidden, counts) -> patch features [patches, ViT width]: norm, drop CLS."""

    def __init__(self, layernorm: nn.Module):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.layernorm = layernorm

    def compile_targets(self) -> list[nn.Module]:
        return []  # a LayerNorm alone: torch.compile makes no graph of it

    def forward(self, inputs):
        hidden, counts = inputs
        if self.seq_parallel is not None:
            hidden = gather_rows(hidden, int(counts.sum()), self.seq_parallel)
        if self.tp_seq is not None:
            hidden = self.tp_seq.gather_packed(hidden, counts)
        hidden = self.layernorm(hidden)
        keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        starts = torch.cumsum(counts, 0) - counts
        keep[starts] = False  # CLS rows
        return hidden[keep]


def encoder_layers(cfg: EncoderConfig, ctx: BuildContext) -> list[LayerDef]:
    """Ordered pipeline layers of the encoder: embed, ``cfg.layers`` blocks, head."""
    seed, module = ctx.seed, ctx.module
    init = layer_seed(seed, module, "init")  # two ViT encoders of one size start apart
    part = lambda pick: _vit_part(cfg, init, pick)  # noqa: E731
    defs = [seeded(seed, module, "embed", lambda: VitEmbed(part(lambda v: v.embeddings)))]
    for i in range(cfg.layers):
        defs.append(seeded(seed, module, f"block{i}", lambda i=i: VitBlock(part(lambda v: v.layers[i]))))
    defs.append(seeded(seed, module, "head", lambda: VitHead(part(lambda v: v.layernorm))))
    return defs


def patches_per_image(h: int, w: int, patch_size: int) -> int:
    return (h // patch_size) * (w // patch_size)


def clear_caches() -> None:
    _full_vit.cache_clear()


layers = encoder_layers

TP_PLAN = (
    (ViTAttention, {"q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row"}),
    (ViTMLP, {"fc1": "col", "fc2": "row"}),
)

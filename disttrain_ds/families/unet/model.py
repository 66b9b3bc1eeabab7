"""Diffusion generator as pipeline layers: a diffusers U-Net split by block (after the projector).

Tuples between layers: ``(sample, emb, cond, *skips)``; the down blocks append their skip
connections and the up blocks consume them, exactly as ``UNet2DConditionModel.forward`` does, so
the split model's output equals the unsplit one. Training objective: DDPM epsilon prediction in
pixel space (the noise, noisy sample and timestep come with the data, so every layout draws the
same noise). The blocks' parts run as ``blocks.py`` adapts them: activations kept in their memory
layout (channels-last on CUDA), and, under tensor parallelism on sequence slices (``tp_seq``), the
transformer blocks on each rank's slice of every image's tokens.
"""

from __future__ import annotations

import copy
import functools
import json

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.activations import GEGLU
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention as DiffusersAttention
from diffusers.models.resnet import ResnetBlock2D
from torch import nn

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.unet.blocks import adapt
from disttrain_ds.families.unet.config import GeneratorConfig
from disttrain_ds.models.layers import LayerDef, layer_seed, seeded


def build_unet(cfg: GeneratorConfig) -> UNet2DConditionModel:
    return UNet2DConditionModel(**unet_kwargs(cfg))


hf_model = build_unet
"""The whole diffusers model this family's layers are cut from (what export writes)."""


def unet_kwargs(cfg: GeneratorConfig) -> dict:
    """``UNet2DConditionModel`` constructor arguments for a generator config."""
    return dict(
        sample_size=cfg.resolution,
        in_channels=cfg.in_channels,
        out_channels=cfg.in_channels,
        down_block_types=tuple(cfg.down_block_types),
        up_block_types=tuple(cfg.up_block_types),
        block_out_channels=tuple(cfg.block_out_channels),
        layers_per_block=cfg.layers_per_block,
        attention_head_dim=tuple(cfg.attention_head_dim),
        cross_attention_dim=cfg.cross_attention_dim,
        norm_num_groups=cfg.norm_num_groups,
        use_linear_projection=cfg.use_linear_projection,
        upcast_attention=cfg.upcast_attention,
    )


def _cache_key(cfg) -> str:
    """The config's own fields as JSON (the projector is not part of this network)."""
    return json.dumps({k: v for k, v in cfg.__dict__.items() if k not in ("projector", "vae")}, sort_keys=True)


@functools.lru_cache(maxsize=4)
def _full_unet(cfg_json: str, seed: int) -> UNet2DConditionModel:
    """The whole U-Net, built once per process; each pipeline layer takes its block from it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_unet(GeneratorConfig(**json.loads(cfg_json)))


def _unet(cfg: GeneratorConfig, seed: int) -> UNet2DConditionModel:
    """The cached initial U-Net. Never train it: layers take private copies via ``_unet_part``."""
    return _full_unet(_cache_key(cfg), seed)


def _unet_part(cfg: GeneratorConfig, seed: int, pick):
    return copy.deepcopy(pick(_unet(cfg, seed)))


class UnetIn(nn.Module):
    """(cond, noisy, timesteps) -> (sample, emb, cond, skip0): time embedding and conv_in."""

    compile_dynamic = "batch"  # (models/compiled.py) inductor fails on its convolutions at symbolic spatial sizes

    def __init__(self, parts: tuple):
        super().__init__()
        self.tp_seq = None
        self.time_proj, self.time_embedding, self.time_embed_act, self.conv_in = parts

    def forward(self, inputs):
        cond, noisy, timesteps = inputs
        t_emb = self.time_proj(timesteps).to(noisy.dtype)
        emb = self.time_embedding(t_emb)
        if self.time_embed_act is not None:
            emb = self.time_embed_act(emb)
        if noisy.is_cuda or self.conv_in.weight.is_contiguous(memory_format=torch.channels_last):
            # cuDNN's fast layout, kept by every layer after this one (models/channels_last.py), even
            # where an optimizer's flat buffers have given the weights back their default layout.
            noisy = noisy.contiguous(memory_format=torch.channels_last)
        sample = self.conv_in(noisy)
        if self.tp_seq is not None:
            # The transformer blocks read cond on their slices only: its gradient, partial on each
            # rank through all of them (and stages), is summed over TP once, here.
            cond = self.tp_seq.replicated(cond)
        return sample, emb, cond, sample


class UnetDown(nn.Module):
    """One down block: appends its skip connections to the tuple."""

    compile_dynamic = "batch"  # (models/compiled.py) inductor fails on its convolutions at symbolic spatial sizes

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = adapt(block)  # layouts kept; transformer blocks on slices under TP

    def forward(self, inputs):
        sample, emb, cond, *skips = inputs
        if getattr(self.block, "has_cross_attention", False):
            sample, res = self.block(hidden_states=sample, temb=emb, encoder_hidden_states=cond)
        else:
            sample, res = self.block(hidden_states=sample, temb=emb)
        return (sample, emb, cond, *skips, *res)


class UnetMid(nn.Module):
    compile_dynamic = "batch"  # (models/compiled.py) inductor fails on its convolutions at symbolic spatial sizes

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = adapt(block)  # layouts kept; transformer blocks on slices under TP

    def forward(self, inputs):
        sample, emb, cond, *skips = inputs
        if getattr(self.block, "has_cross_attention", False):
            sample = self.block(sample, emb, encoder_hidden_states=cond)
        else:
            sample = self.block(sample, emb)
        return (sample, emb, cond, *skips)


class UnetUp(nn.Module):
    """One up block: consumes as many skips as it has resnets; the last one drops emb and cond."""

    compile_dynamic = "batch"  # (models/compiled.py) inductor fails on its convolutions at symbolic spatial sizes

    def __init__(self, block: nn.Module, last: bool):
        super().__init__()
        self.block = adapt(block)  # layouts kept; transformer blocks on slices under TP
        self.last = last

    def forward(self, inputs):
        sample, emb, cond, *skips = inputs
        n = len(self.block.resnets)
        res, skips = tuple(skips[-n:]), skips[:-n]
        if getattr(self.block, "has_cross_attention", False):
            sample = self.block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res, encoder_hidden_states=cond)
        else:
            sample = self.block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res)
        if self.last:
            return sample
        return (sample, emb, cond, *skips)


class UnetOut(nn.Module):
    """sample -> predicted noise: norm, activation, conv_out."""

    compile_dynamic = "batch"  # (models/compiled.py) inductor fails on its convolutions at symbolic spatial sizes

    def __init__(self, parts: tuple):
        super().__init__()
        self.conv_norm_out, self.conv_act, self.conv_out = parts

    def forward(self, inputs):
        sample = inputs[0] if isinstance(inputs, tuple) else inputs
        if self.conv_norm_out is not None:
            sample = self.conv_act(self.conv_norm_out(sample))
        return self.conv_out(sample)


def _in_parts(u: UNet2DConditionModel) -> tuple:
    return u.time_proj, u.time_embedding, u.time_embed_act, u.conv_in


def _out_parts(u: UNet2DConditionModel) -> tuple:
    return u.conv_norm_out, u.conv_act, u.conv_out


def generator_layers(cfg: GeneratorConfig, ctx: BuildContext) -> list[LayerDef]:
    """Ordered pipeline layers of the U-Net: in (time embedding, conv_in), downs, mid, ups, out;
    the first takes (cond [n, K, cross_attention_dim], noisy, timesteps)."""
    if cfg.resolution % (2 ** (len(cfg.block_out_channels) - 1)):
        raise ValueError(
            f"generator.resolution {cfg.resolution} must be divisible by {2 ** (len(cfg.block_out_channels) - 1)}"
        )
    seed, module = ctx.seed, ctx.module
    init = layer_seed(seed, module, "init")  # two U-Nets of one size start apart
    part = lambda pick: _unet_part(cfg, init, pick)  # noqa: E731
    defs = [
        seeded(seed, module, "unet_in", lambda: UnetIn(part(_in_parts))),
    ]
    for i in range(len(cfg.down_block_types)):
        defs.append(seeded(seed, module, f"down{i}", lambda i=i: UnetDown(part(lambda u: u.down_blocks[i]))))
    defs.append(seeded(seed, module, "mid", lambda: UnetMid(part(lambda u: u.mid_block))))
    n_up = len(cfg.up_block_types)
    for i in range(n_up):
        up = lambda i=i: UnetUp(part(lambda u: u.up_blocks[i]), i == n_up - 1)  # noqa: E731
        defs.append(seeded(seed, module, f"up{i}", up))
    defs.append(seeded(seed, module, "unet_out", lambda: UnetOut(part(_out_parts))))
    return defs


def clear_caches() -> None:
    _full_unet.cache_clear()


layers = generator_layers


def feed_forward_plan(ff: FeedForward) -> dict[str, str]:
    """A GEGLU feed-forward's first projection stacks (hidden, gate): both halves split alike."""
    return {"net.0.proj": "col_pairs" if isinstance(ff.net[0], GEGLU) else "col", "net.2": "row"}


RESNET_PLAN = {"conv1": "col", "time_emb_proj": "col", "norm2": "groups", "conv2": "row"}
"""A ResNet's two convolutions split Megatron-style: conv1's output channels (and the time embedding's
projection added to them, and the GroupNorm after them, whole groups per rank), then conv2's input
channels with its partial sums all-reduced; its first norm and shortcut read the whole input."""

TP_PLAN = (
    (DiffusersAttention, {"to_q": "col", "to_k": "col", "to_v": "col", "to_out.0": "row", "heads": "divide"}),
    (FeedForward, feed_forward_plan),
    (ResnetBlock2D, RESNET_PLAN),
)

"""Diffusion transformer generator as pipeline layers: a diffusers ``PixArtTransformer2DModel``
split by block (PixArt-alpha: patch embedding, adaLN-single timestep conditioning, transformer
blocks with cross-attention to the conditioning sequence, a modulated linear head).

Layers and the tuples between them (n images, N = (R / patch)^2 tokens, D = heads x head_dim)::

    dit_in    (cond [n, K, cross], noisy [n, C, R, R], timesteps int64 [n])
              -> (hidden [n, N, D], t_mod [n, 6D], t_emb [n, D], cond)
    block{i}  -> (hidden, t_mod, t_emb, cond); the last block drops t_mod and cond -> (hidden, t_emb)
    dit_out   (hidden, t_emb) -> predicted noise [n, C, R, R]

``t_mod`` (adaLN-single's shared modulation) and ``cond`` feed every block, ``t_emb`` only the
head; the last block drops what no later layer reads, so every floating tensor crossing a
pipeline stage receives a gradient. The patch grid is square (R x R samples), so the head
recovers it from N; no sizes travel as Python values.

Under tensor parallelism on sequence slices (``tp_seq``, ``parallel/tp_sequence.py::attach``)
``dit_in`` keeps this rank's contiguous slice of every image's tokens, each block runs
``models/diffusers_tp.py::basic_block`` (collectives overlapped with its GEMMs; ``t_mod`` and ``cond`` whole, their
gradients summed over TP once, in ``dit_in``), and ``dit_out`` joins the slices before its norm.

Why PixArt's caption projection is left out: it is a Linear-GELU-Linear MLP from T5-XXL's 4096
features to the model width, i.e. the same job and form as the output projector the caller puts
before ``dit_in`` (LLM width -> ``cross_attention_dim``); a second MLP would add depth but no
capability, and its pretrained weights are fitted to T5 features, which LLM states are not. So
``cross_attention_dim`` is both the projector's output and the blocks' cross-attention input, as
in the U-Net family. Split layer by layer, the model computes exactly what diffusers' forward does
with ``caption_channels=None``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math

import torch
from diffusers import PixArtTransformer2DModel
from diffusers.models.activations import GEGLU
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention as DiffusersAttention
from torch import nn

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.dit.config import DiTConfig
from disttrain_ds.models.diffusers_tp import basic_block, check_block
from disttrain_ds.models.layers import LayerDef, SlicedLayer, layer_seed, seeded


def pixart_kwargs(cfg: DiTConfig) -> dict:
    """``PixArtTransformer2DModel`` constructor arguments for a DiT config."""
    return dict(
        num_attention_heads=cfg.heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_channels,
        out_channels=cfg.in_channels * (2 if cfg.learn_sigma else 1),
        num_layers=cfg.layers,
        cross_attention_dim=cfg.cross_attention_dim,
        sample_size=cfg.resolution,
        patch_size=cfg.patch_size,
        caption_channels=None,  # the caller's projector does its job (module docstring)
        # diffusers turns on resolution/aspect-ratio conditions for sample_size 128 (PixArt 1024);
        # the data path has no such inputs, so they stay off at every size.
        use_additional_conditions=False,
    )


def build_pixart(cfg: DiTConfig) -> PixArtTransformer2DModel:
    return PixArtTransformer2DModel(**pixart_kwargs(cfg))


hf_model = build_pixart
"""The whole diffusers model this family's layers are cut from (what export writes)."""


@functools.lru_cache(maxsize=4)
def _full_pixart(cfg_json: str, seed: int, device: str) -> PixArtTransformer2DModel:
    """The whole model, built once per process (and default device: a meta build for parameter
    counting never serves a real one); each pipeline layer deep-copies its part of it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_pixart(DiTConfig(**json.loads(cfg_json)))


def _pixart(cfg: DiTConfig, seed: int) -> PixArtTransformer2DModel:
    """The cached initial model. Never train it: layers take private copies via ``_part``."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("projector", "vae")}
    return _full_pixart(json.dumps(fields, sort_keys=True), seed, str(torch.get_default_device()))


def _part(cfg: DiTConfig, seed: int, pick):
    return copy.deepcopy(pick(_pixart(cfg, seed)))


class DiTIn(nn.Module):
    """(cond, noisy, timesteps) -> (hidden, t_mod, t_emb, cond): patch embedding (with its fixed
    sin-cos positions) and adaLN-single's timestep embedding and shared modulation."""

    def __init__(self, parts: tuple):
        super().__init__()
        self.tp_seq = None
        self.pos_embed, self.adaln_single = parts

    def forward(self, inputs):
        cond, noisy, timesteps = inputs
        # The patch embedding's output is a transposed view; a pipeline stage can only send contiguous tensors.
        hidden = self.pos_embed(noisy).contiguous()
        t_mod, t_emb = self.adaln_single(timesteps, None, batch_size=noisy.shape[0], hidden_dtype=hidden.dtype)
        if self.tp_seq is not None:
            hidden = self.tp_seq.scatter(hidden)
            # Every block reads t_mod and cond on its slice only: their gradients, partial on each
            # rank through all the blocks (and stages), are summed over TP once, here.
            t_mod, cond = self.tp_seq.replicated(t_mod), self.tp_seq.replicated(cond)
        return hidden, t_mod, t_emb, cond


class DiTBlock(nn.Module):
    """One ``BasicTransformerBlock`` (adaLN-single self-attention, cross-attention to cond, MLP)."""

    tp_seq_region = True  # on slices: replicated weights' gradients summed over TP

    def __init__(self, block: nn.Module, last: bool):
        super().__init__()
        self.tp_seq = None
        self.block = block
        self.last = last
        object.__setattr__(self, "sliced", SlicedLayer(self.block, basic_block))  # unregistered: no new names

    def compile_targets(self) -> list[nn.Module]:
        # On slices the collectives run between the block's modules: its written-out forward is compiled.
        return [self.sliced if self.tp_seq is not None else self]

    def forward(self, inputs):
        hidden, t_mod, t_emb, cond = inputs
        if self.tp_seq is not None:
            check_block(self.block)  # settings the written-out forward computes (the family's own always are)
            hidden = self.sliced(hidden, cond, self.tp_seq, t_mod)
        else:
            hidden = self.block(hidden, encoder_hidden_states=cond, timestep=t_mod)
        if self.last:
            return hidden, t_emb
        return hidden, t_mod, t_emb, cond


class DiTOut(nn.Module):
    """(hidden, t_emb) -> predicted noise: final norm modulated by t_emb, proj_out, unpatchify. On
    slices the norm and projection run on this rank's tokens and the projected patches (p * p * c
    values per token, not the width) are joined."""

    tp_seq_region = True  # on slices: its modulation table's and projection's gradients summed over TP

    def __init__(self, parts: tuple, patch: int, out_channels: int, in_channels: int):
        super().__init__()
        self.tp_seq = None
        self.norm_out, self.scale_shift_table, self.proj_out = parts
        self.patch, self.out_channels, self.in_channels = patch, out_channels, in_channels

    def forward(self, inputs):
        hidden, t_emb = inputs
        if self.tp_seq is not None:
            t_emb = self.tp_seq.replicated(t_emb)  # read by this rank's tokens only: its gradient summed over TP
        shift, scale = (self.scale_shift_table[None] + t_emb[:, None]).chunk(2, dim=1)
        hidden = self.proj_out(self.norm_out(hidden) * (1 + scale) + shift)
        if self.tp_seq is not None:
            hidden = self.tp_seq.gather(hidden)
        n, tokens, _ = hidden.shape
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ValueError(f"dit_out: {tokens} tokens are not a square patch grid")
        p, c = self.patch, self.out_channels
        hidden = hidden.reshape(n, side, side, p, p, c)
        out = torch.einsum("nhwpqc->nchpwq", hidden).reshape(n, c, side * p, side * p)
        # Learned-sigma checkpoints also predict the variance; the epsilon objective reads the first half.
        return out[:, : self.in_channels] if c != self.in_channels else out


def _in_parts(m: PixArtTransformer2DModel) -> tuple:
    return m.pos_embed, m.adaln_single


def _out_parts(m: PixArtTransformer2DModel) -> tuple:
    return m.norm_out, m.scale_shift_table, m.proj_out


def dit_layers(cfg: DiTConfig, ctx: BuildContext) -> list[LayerDef]:
    """Ordered pipeline layers of the DiT: in (patch + timestep embedding), one per block, out;
    the first takes (cond [n, K, cross_attention_dim], noisy, timesteps)."""
    if cfg.resolution % cfg.patch_size:
        raise ValueError(f"generator.resolution {cfg.resolution} must be divisible by patch_size {cfg.patch_size}")
    if cfg.layers < 1:
        raise ValueError(f"generator.layers must be at least 1 (the blocks read the condition), got {cfg.layers}")
    seed, module = ctx.seed, ctx.module
    init = layer_seed(seed, module, "init")  # two DiTs of one size start apart
    part = lambda pick: _part(cfg, init, pick)  # noqa: E731
    out_channels = cfg.in_channels * (2 if cfg.learn_sigma else 1)
    defs = [seeded(seed, module, "dit_in", lambda: DiTIn(part(_in_parts)))]
    for i in range(cfg.layers):
        block = lambda i=i: DiTBlock(part(lambda m: m.transformer_blocks[i]), last=i == cfg.layers - 1)  # noqa: E731
        defs.append(seeded(seed, module, f"block{i}", block))
    head = lambda: DiTOut(part(_out_parts), cfg.patch_size, out_channels, cfg.in_channels)  # noqa: E731
    defs.append(seeded(seed, module, "dit_out", head))
    return defs


def clear_caches() -> None:
    _full_pixart.cache_clear()


layers = dit_layers


# The same diffusers classes (and plan) as the U-Net family's: ``shard_layer`` takes the first
# matching entry, so the repeat is harmless, and this family stays complete on its own.
# adaLN-single, the patch embedding and the head stay replicated (small next to the blocks).
def feed_forward_plan(ff: FeedForward) -> dict[str, str]:
    """A GEGLU feed-forward's first projection stacks (hidden, gate): both halves split alike."""
    return {"net.0.proj": "col_pairs" if isinstance(ff.net[0], GEGLU) else "col", "net.2": "row"}


TP_PLAN = (
    (DiffusersAttention, {"to_q": "col", "to_k": "col", "to_v": "col", "to_out.0": "row", "heads": "divide"}),
    (FeedForward, feed_forward_plan),
)

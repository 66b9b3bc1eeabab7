"""Audio encoder as pipeline layers: Whisper's conv stem + positions, its transformer layers, final norm.

Clips of different durations give different numbers of rows, so activations travel packed like
the ViT's: the first layer reads ``(flat, shapes)`` (every clip's log-mel features [n_mels, frames]
flattened and concatenated, plus an int64 [n, 2] (n_mels, frames) table, as images travel with
their (H, W)); later layers pass ``(hidden [sum of rows, width], counts int64 [n])``. Attention
must stay within a clip, so each block runs the clips of equal length together as one batch (no
padding, no mask: exact). The stride-2 convolution makes ``frames // 2`` rows per clip, and a
clip of ``r`` rows adds the first ``r`` of Whisper's sinusoidal positions, which is what
transformers' WhisperEncoder computes for a clip padded to nothing.

Under sequence parallelism (``seq_parallel``, set by ``parallel/sequence_parallel.py::attach``) the
stem keeps this rank's slice of the packed rows, each block attends through the exchange of
``models/packed_sp.py``, and the head gathers the rows back before its norm. Under tensor
parallelism on sequence slices (``tp_seq``) likewise, each block running ``sharded.whisper_layer``
(``models/packed_tp.py``: collectives overlapped with its GEMMs).

The parts are taken from one whole transformers ``WhisperEncoder`` (HF's own init), so a
checkpoint of that class loads key for key (``FAMILY.hf_rules``).
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperAttention, WhisperEncoder, WhisperEncoderLayer

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.whisper.config import AudioEncoderConfig
from disttrain_ds.families.whisper.sharded import whisper_layer
from disttrain_ds.models.layers import LayerDef, SlicedLayer, layer_seed, seeded
from disttrain_ds.models.packed import by_length, pack_clips, per_item, unpack_clips  # noqa: F401 (pack_clips: callers' import path)
from disttrain_ds.models.packed_sp import gather_rows, shard_rows, sp_layer
from disttrain_ds.models.packed_tp import on_items, on_slices


def hf_config(cfg: AudioEncoderConfig) -> WhisperConfig:
    """The transformers config of the encoder ``cfg`` describes (dropouts off: the runtime is exact)."""
    if cfg.max_frames <= 0 or cfg.max_frames % 2:
        raise ValueError(f"max_frames must be a positive even number of mel frames, got {cfg.max_frames}")
    return WhisperConfig(
        num_mel_bins=cfg.n_mels,
        d_model=cfg.hidden_size,
        encoder_layers=cfg.layers,
        encoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.ffn_hidden,
        decoder_attention_heads=cfg.heads,  # unused here; keeps the config a valid whole model
        max_source_positions=cfg.max_frames // 2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        attn_implementation="sdpa",
    )


class LocalHeadsAttention(WhisperAttention):
    """WhisperAttention whose head count follows its key projection's width.

    transformers reshapes queries with ``-1`` heads but keys and values with the fixed
    ``num_heads``. Tensor parallelism leaves ``heads / tp`` heads' columns on a rank; with the
    fixed count that reshape folds heads into the sequence axis and the layer fails with a shape
    error. Deriving the count from the weights is right for the whole layer and for every shard,
    whoever splits it.
    """

    @property
    def num_heads(self) -> int:
        return self.k_proj.weight.shape[0] // self.head_dim

    @num_heads.setter
    def num_heads(self, value: int) -> None:
        """Ignored: the weights decide (``__init__`` or a TP pass may still assign it)."""


def hf_model(cfg: AudioEncoderConfig) -> WhisperEncoder:
    """The whole transformers encoder this family's layers are cut from (what export writes)."""
    return WhisperEncoder(hf_config(cfg))


def _sizes(cfg: AudioEncoderConfig) -> tuple[int, ...]:
    """The config fields that shape the network (the cache key; ``frozen`` etc. do not matter)."""
    return (cfg.n_mels, cfg.hidden_size, cfg.layers, cfg.heads, cfg.ffn_hidden, cfg.max_frames)


@functools.lru_cache(maxsize=4)
def _full_whisper(sizes: tuple[int, ...], seed: int) -> WhisperEncoder:
    """The whole HF encoder, built once per process with HF's own init; layers are taken from it."""
    n_mels, hidden, layers, heads, ffn, max_frames = sizes
    cfg = AudioEncoderConfig(n_mels=n_mels, hidden_size=hidden, layers=layers, heads=heads,
                             ffn_hidden=ffn, max_frames=max_frames)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = WhisperEncoder(hf_config(cfg))
    for layer in encoder.layers:
        layer.self_attn.__class__ = LocalHeadsAttention
    return encoder


def _part(cfg: AudioEncoderConfig, seed: int, pick: Callable[[WhisperEncoder], nn.Module]) -> nn.Module:
    """A private copy of one part of the cached initial encoder (the cache itself is never trained)."""
    return copy.deepcopy(pick(_full_whisper(_sizes(cfg), seed)))


class WhisperEmbed(nn.Module):
    """(flat, shapes) -> (hidden, counts): conv1, GELU, stride-2 conv2, GELU, + positions, per clip."""

    def __init__(self, conv1: nn.Conv1d, conv2: nn.Conv1d, embed_positions: nn.Embedding):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.conv1, self.conv2, self.embed_positions = conv1, conv2, embed_positions

    def _check(self, clips: list[torch.Tensor]) -> None:
        """One line naming the first clip the encoder cannot read (instead of a conv shape error)."""
        mels, max_frames = self.conv1.in_channels, 2 * self.embed_positions.num_embeddings
        for i, c in enumerate(clips):
            m, frames = c.shape
            if m != mels or frames <= 0 or frames % 2 or frames > max_frames:
                raise ValueError(f"audio clip {i} has shape ({m}, {frames}); the encoder reads {mels} mel bins "
                                 f"and an even number of frames up to max_frames={max_frames}")

    def compile_targets(self) -> list[nn.Module]:
        return []  # clips grouped by length on the host

    def forward(self, inputs):
        flat, shapes = inputs
        clips = unpack_clips(flat, shapes)
        self._check(clips)
        dtype = self.conv1.weight.dtype
        out: list[torch.Tensor | None] = [None] * len(clips)
        for _, idx in by_length([c.shape[1] for c in clips]).items():
            x = torch.stack([clips[i] for i in idx]).to(dtype)
            x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).permute(0, 2, 1)
            x = x + self.embed_positions.weight[: x.shape[1]]
            for j, i in enumerate(idx):
                out[i] = x[j]
        hidden = torch.cat(out) if out else flat.new_zeros(0, self.conv2.out_channels, dtype=dtype)
        counts = torch.tensor([o.shape[0] for o in out], dtype=torch.long, device=hidden.device)
        if self.seq_parallel is not None:
            hidden = shard_rows(hidden, self.seq_parallel)
        if self.tp_seq is not None:
            hidden = self.tp_seq.scatter_packed(hidden)
        return hidden, counts


class WhisperBlock(nn.Module):
    """(hidden, counts) -> (hidden, counts): one WhisperEncoderLayer, attention per clip."""

    tp_seq_region = True  # on slices: replicated weights' gradients summed over TP
    packed_items = True  # its written-out forward attends packed items: flex warmed up before step 1

    def __init__(self, layer: WhisperEncoderLayer):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.layer = layer
        object.__setattr__(self, "sliced", SlicedLayer(self.layer, whisper_layer))  # unregistered: no new names

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
        return on_items(self.sliced, lambda batch: self.layer(batch, None), hidden, counts), counts


class WhisperHead(nn.Module):
    """(hidden, counts) -> audio features [sum of rows, encoder width]: the final LayerNorm."""

    def __init__(self, layer_norm: nn.LayerNorm):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.layer_norm = layer_norm

    def compile_targets(self) -> list[nn.Module]:
        return []  # a LayerNorm alone: torch.compile makes no graph of it

    def forward(self, inputs):
        hidden, counts = inputs
        if self.seq_parallel is not None:
            hidden = gather_rows(hidden, int(counts.sum()), self.seq_parallel)
        if self.tp_seq is not None:
            hidden = self.tp_seq.gather_packed(hidden, counts)
        return self.layer_norm(hidden)


def encoder_layers(cfg: AudioEncoderConfig, ctx: BuildContext) -> list[LayerDef]:
    """Ordered pipeline layers of the encoder: embed, ``cfg.layers`` blocks, head."""
    seed, module = ctx.seed, ctx.module
    init = layer_seed(seed, module, "init")  # two encoders of one size start apart
    part = lambda pick: _part(cfg, init, pick)  # noqa: E731
    embed = lambda: WhisperEmbed(part(lambda w: w.conv1), part(lambda w: w.conv2), part(lambda w: w.embed_positions))  # noqa: E731
    defs = [seeded(seed, module, "embed", embed)]
    for i in range(cfg.layers):
        defs.append(seeded(seed, module, f"block{i}", lambda i=i: WhisperBlock(part(lambda w: w.layers[i]))))
    defs.append(seeded(seed, module, "head", lambda: WhisperHead(part(lambda w: w.layer_norm))))
    return defs


def clear_caches() -> None:
    _full_whisper.cache_clear()


layers = encoder_layers

TP_PLAN = (
    (WhisperAttention, {"q_proj": "col", "k_proj": "col", "v_proj": "col", "out_proj": "row"}),
    # Whisper's MLP has no module of its own: fc1 / fc2 sit on the layer.
    (WhisperEncoderLayer, {"fc1": "col", "fc2": "row"}),
)

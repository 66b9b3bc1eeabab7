"""Cases shared by the CPU (gloo) and CUDA (NCCL) tests of encoders (ViT, CLIP and SigLIP towers,
Whisper) on slices of their packed rows: the encoder run whole and sharded over a TP group of two,
compared layer by layer."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from tp_seq_cases import sharded_layers, worst_grad_error

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.clip.config import VisionTowerConfig
from disttrain_ds.families.clip.model import CLIP, tower_layers
from disttrain_ds.families.siglip.model import SIGLIP
from disttrain_ds.families.vit.config import EncoderConfig
from disttrain_ds.families.vit.model import encoder_layers
from disttrain_ds.families.whisper.config import AudioEncoderConfig
from disttrain_ds.families.whisper.model import encoder_layers as whisper_layers
from disttrain_ds.models import packed_tp
from disttrain_ds.models.compiled import compile_layers
from disttrain_ds.models.packed import host_sizes, pack_clips
from disttrain_ds.models.packed_tp import WholeRows
from disttrain_ds.models.pixels import pack_images

MIXED = (32, 16, 32, 24)
"""Image sides: 17 + 5 + 17 + 10 = 49 rows with a CLS token each, padded to 50 for two slices of 25."""
CASES = [("vit", MIXED, 3), ("vit", MIXED, 1), ("vit", (16, 16, 16), 2), ("vit", (), 4), ("clip", MIXED, 3),
         ("siglip", MIXED, 2), ("whisper", (12, 20, 14), 2)]
"""(family, image sides or clip frames, chunks): mixed sizes with padding, one chunk, equal sizes
(one batched attention, 15 rows padded to 16), no image at all; the CLIP tower (CLS, pre-LayerNorm)
and SigLIP's (no CLS: 45 rows padded to 46); Whisper clips of 6 + 10 + 7 rows, padded to 24."""
CLS = {"vit": True, "clip": True, "siglip": False}
"""Whether the family's embedding puts a CLS row before each image's patches."""


def rows(family: str, sizes: tuple[int, ...]) -> tuple[int, int]:
    """(rows between blocks, rows the head returns) for items of ``sizes``."""
    if family == "whisper":
        return sum(f // 2 for f in sizes), sum(f // 2 for f in sizes)
    patches = sum((s // 8) ** 2 for s in sizes)
    return patches + CLS[family] * len(sizes), patches


def encoder_defs(family: str):
    """The cases' two-block encoder of ``family`` as pipeline layer definitions."""
    ctx = BuildContext(module="encoder", seed=3, llm_hidden=32)
    if family == "whisper":
        return whisper_layers(AudioEncoderConfig(n_mels=8, hidden_size=32, layers=2, heads=4, ffn_hidden=64,
                                                 max_frames=40), ctx)
    if family == "vit":
        return encoder_layers(EncoderConfig(hidden_size=32, layers=2, heads=4, ffn_hidden=64, patch_size=8,
                                            image_size=32), ctx)
    cfg = VisionTowerConfig(family=family, hidden_size=32, layers=2, heads=4, ffn_hidden=64, patch_size=8,
                            image_size=32, feature_layer=-1)
    return tower_layers(cfg, ctx, CLIP if family == "clip" else SIGLIP)


def _run(layers, flat, hw, weight) -> tuple[torch.Tensor, torch.Tensor]:
    x = (flat, hw)
    for layer in layers:
        x = layer(x)
    return (x * weight).sum(), x


def vit_case(rank: int, group, family: str, sides: tuple[int, ...], chunks: int, hooks: bool = True,
             backend: str | None = None, device: str = "cpu") -> dict:
    """One rank's run: the sharded encoder's loss and output against the whole encoder's, the worst
    gradient error (relative to the layer's largest gradient) and where; ``backend``: the first
    sharded block compiled with it."""
    defs = encoder_defs(family)
    flat, hw, weight = _inputs(family, sides, device)
    between = rows(family, sides)[0]

    ref = [d.build().to(device) for d in defs]
    ref_loss, ref_out = _run(ref, flat, hw, weight)
    if between:
        ref_loss.backward()

    sharded = sharded_layers(defs, group, rank, chunks, hooks, device)
    counter = None
    if backend is not None:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compile_layers(sharded[1:2], backend=counter)
    sliced = sharded[0]((flat, hw))[0].shape[0]
    loss, out = _run(sharded, flat, hw, weight)
    if between:
        loss.backward()

    worst, where = worst_grad_error(ref, sharded, defs, rank)
    out_err = float((out - ref_out).abs().max()) if out.numel() else 0.0
    return {"loss": float(loss), "ref_loss": float(ref_loss), "out_err": out_err,
            "shape": tuple(out.shape), "sliced": sliced, "grad_err": worst, "where": where,
            "graphs": None if counter is None else counter.frame_count}




def _inputs(family: str, sides: tuple[int, ...], device: str):
    g = torch.Generator().manual_seed(5)
    if family == "whisper":
        flat, hw = pack_clips([torch.randn(8, f, generator=g) for f in sides])
    else:
        flat, hw = pack_images([torch.randn(3, s, s, generator=g) for s in sides])
    weight = torch.randn(rows(family, sides)[1], 32, generator=g)
    return flat.to(device), hw.to(device), weight.to(device)


def whole_rows_case(family: str, sides: tuple[int, ...], device: str = "cpu", one_item: bool = False,
                    dtype: torch.dtype = torch.float32) -> dict:
    """The encoder without TP with its blocks written out over all packed rows at once
    (``WholeRows``), against the library's layers run per item length: on the CPU each block's
    written-out forward called directly (attention per length), on CUDA the block itself
    (``on_items``: attention in one flex call); ``one_item``: the control, every row attending to
    every other as if the rows were one item; ``dtype``: the layers' and inputs' (on CUDA bfloat16
    attends through varlen flash attention, float32 through flex)."""
    defs = encoder_defs(family)
    flat, hw, weight = _inputs(family, sides, device)
    flat, weight = flat.to(dtype), weight.to(dtype)
    ref = [d.build().to(device, dtype) for d in defs]
    per_length = packed_tp.varlen_items
    packed_tp.varlen_items = lambda hidden, sizes: False  # the reference: the library's layer per length
    try:
        ref_loss, ref_out = _run(ref, flat, hw, weight)
    finally:
        packed_tp.varlen_items = per_length
    ref_loss.backward()

    ours = [d.build().to(device, dtype) for d in defs]
    x = (flat, hw)
    for layer in ours:
        if hasattr(layer, "sliced") and (device == "cpu" or one_item):  # a block, written out
            hidden, counts = x
            sizes = [hidden.shape[0]] if one_item else host_sizes(counts)
            x = (layer.sliced(hidden, torch.tensor(sizes), WholeRows), counts)
        else:
            x = layer(x)
    loss = (x * weight).sum()
    loss.backward()
    worst, where = worst_grad_error(ref, ours, defs, 0)
    return {"loss": float(loss), "ref_loss": float(ref_loss), "out_err": float((x - ref_out).abs().max()),
            "grad_err": worst, "where": where}

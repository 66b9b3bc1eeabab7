"""Cases shared by the CPU (gloo) and CUDA (NCCL) tests of a ViT encoder on slices of its packed
image rows: the encoder run whole and sharded over a TP group of two, compared layer by layer."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from tp_seq_cases import WORLD, _expected_grad

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.vit.config import EncoderConfig
from disttrain_ds.families.vit.model import encoder_layers
from disttrain_ds.models.compiled import compile_layers
from disttrain_ds.models.pixels import pack_images
from disttrain_ds.parallel.tensor_parallel import TPContext, shard_layer
from disttrain_ds.parallel.tp_sequence import TPSeqContext, attach

MIXED = (32, 16, 32, 24)
"""Image sides: 17 + 5 + 17 + 10 = 49 rows (CLS included), padded to 50 for two slices of 25."""
CASES = [(MIXED, 3), (MIXED, 1), ((16, 16, 16), 2), ((), 4)]
"""(image sides, chunks): mixed sizes with padding, one chunk, equal sizes (one batched attention,
no padding: 15 rows -> 16), no image at all."""


def _run(layers, flat, hw, weight) -> tuple[torch.Tensor, torch.Tensor]:
    x = (flat, hw)
    for layer in layers:
        x = layer(x)
    return (x * weight).sum(), x


def vit_case(rank: int, group, sides: tuple[int, ...], chunks: int, hooks: bool = True,
             backend: str | None = None, device: str = "cpu") -> dict:
    """One rank's run: the sharded encoder's loss and output against the whole encoder's, the worst
    gradient error (relative to the layer's largest gradient) and where; ``backend``: the first
    sharded block compiled with it."""
    cfg = EncoderConfig(hidden_size=32, layers=2, heads=4, ffn_hidden=64, patch_size=8, image_size=32)
    defs = encoder_layers(cfg, BuildContext(module="encoder", seed=3, llm_hidden=32))
    g = torch.Generator().manual_seed(5)
    flat, hw = pack_images([torch.randn(3, s, s, generator=g) for s in sides])
    flat, hw = flat.to(device), hw.to(device)
    weight = torch.randn(sum((s // 8) ** 2 for s in sides), 32, generator=g).to(device)  # the head drops CLS
    rows = sum((s // 8) ** 2 + 1 for s in sides)

    ref = [d.build().to(device) for d in defs]
    ref_loss, ref_out = _run(ref, flat, hw, weight)
    if rows:
        ref_loss.backward()

    tp = TPContext(group, rank, WORLD, 0)
    ctx = TPSeqContext(tp, chunks)
    sharded = []
    for d in defs:
        layer = shard_layer(d.build(), tp).to(device)
        if not hooks:
            layer.tp_seq_region = False  # the fault to catch: slice-only gradients left unsummed
        sharded.append(attach(layer, ctx))
    counter = None
    if backend is not None:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compile_layers(sharded[1:2], backend=counter)
    sliced = sharded[0]((flat, hw))[0].shape[0]
    loss, out = _run(sharded, flat, hw, weight)
    if rows:
        loss.backward()

    worst, where = 0.0, ""
    for r_layer, s_layer, d in zip(ref, sharded, defs):
        ref_grads = dict(r_layer.named_parameters())
        # Errors relative to the layer's largest gradient: a key bias's gradient is zero up to
        # rounding (softmax ignores a shift shared by every key), so its own scale is noise.
        scale = max((float(p.grad.abs().max()) for p in ref_grads.values() if p.grad is not None), default=0.0)
        for name, p in s_layer.named_parameters():
            if ref_grads[name].grad is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            want = _expected_grad(ref_grads[name].grad, p, rank)
            err = float((p.grad - want).abs().max()) / max(scale, 1e-12)
            if err > worst:
                worst, where = err, f"{d.name}.{name}"
    return {"loss": float(loss), "ref_loss": float(ref_loss), "out_err": float((out - ref_out).abs().max()) if out.numel() else 0.0,
            "shape": tuple(out.shape), "sliced": sliced, "grad_err": worst, "where": where,
            "graphs": None if counter is None else counter.frame_count}



"""Cases shared by the CPU (gloo) and CUDA (NCCL) tests of the DiT generator on sequence slices: a
two-block PixArt run whole and sharded over a TP group of two, compared layer by layer, the condition's
gradient (what the output projector before it receives) included."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from tp_seq_cases import WORLD, _expected_grad, sharded_layers

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.dit.config import DiTConfig
from disttrain_ds.families.dit.model import dit_layers
from disttrain_ds.models.compiled import compile_layers

COND = 5
"""Condition tokens per image."""
CASES = [(16, 3, 3), (12, 1, 3), (16, 4, 1)]
"""(resolution, chunks, images): 64 patch tokens (32 per slice) in 3 pieces; 36 (18 per slice)
unchunked; one image, where the modulation table and ``t_mod`` have one shape, so autograd hands
both the same gradient tensor (a sum over TP made in place would change the other's)."""


def config(resolution: int) -> DiTConfig:
    """The cases' two-block DiT: 4 heads of 8 (width 32), condition width 24, patch 2."""
    return DiTConfig(heads=4, head_dim=8, layers=2, cross_attention_dim=24, resolution=resolution, in_channels=4,
                     query_tokens=COND)


def _run(layers, cond, noisy, timesteps, weight) -> tuple[torch.Tensor, torch.Tensor]:
    x = (cond, noisy, timesteps)
    for layer in layers:
        x = layer(x)
    return (x * weight).sum(), x


def dit_case(rank: int, group, resolution: int, chunks: int, images: int, hooks: bool = True,
             backend: str | None = None, device: str = "cpu") -> dict:
    """One rank's run: the sharded DiT's loss, output and condition gradient against the whole
    model's, the worst parameter-gradient error (relative to the layer's largest gradient) and
    where; ``backend``: the sharded blocks compiled with it, graphs counted per block."""
    defs = dit_layers(config(resolution), BuildContext(module="generator", seed=3, llm_hidden=32))
    g = torch.Generator().manual_seed(5)
    cond = torch.randn(images, COND, 24, generator=g).to(device)
    noisy = torch.randn(images, 4, resolution, resolution, generator=g).to(device)
    timesteps = torch.randint(0, 1000, (images,), generator=g).to(device)
    weight = torch.randn(images, 4, resolution, resolution, generator=g).to(device)

    ref = [d.build().to(device) for d in defs]
    ref_cond = cond.clone().requires_grad_()
    ref_loss, ref_out = _run(ref, ref_cond, noisy, timesteps, weight)
    ref_loss.backward()

    sharded = sharded_layers(defs, group, rank, chunks, hooks, device)
    sliced = tuple(sharded[0]((cond, noisy, timesteps))[0].shape)
    between = sharded[1](sharded[0]((cond, noisy, timesteps)))[0]
    counter = None
    if backend is not None:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compile_layers(sharded[1:2], backend=counter)
    own_cond = cond.clone().requires_grad_()
    loss, out = _run(sharded, own_cond, noisy, timesteps, weight)
    loss.backward()

    worst, where = 0.0, ""
    for r_layer, s_layer, d in zip(ref, sharded, defs):
        ref_grads = dict(r_layer.named_parameters())
        # Relative to the layer's largest gradient: a key bias's gradient is zero up to rounding.
        scale = max(float(p.grad.abs().max()) for p in ref_grads.values())
        for name, p in s_layer.named_parameters():
            want = _expected_grad(ref_grads[name].grad, p, rank)
            err = float((p.grad - want).abs().max()) / max(scale, 1e-12)
            if err > worst:
                worst, where = err, f"{d.name}.{name}"
    cond_err = float((own_cond.grad - ref_cond.grad).abs().max() / ref_cond.grad.abs().max())
    return {"loss": float(loss), "ref_loss": float(ref_loss), "out_err": float((out - ref_out).abs().max()),
            "sliced": sliced, "contiguous": between.is_contiguous(), "grad_err": worst, "where": where, "cond_err": cond_err,
            "graphs": None if counter is None else counter.frame_count}

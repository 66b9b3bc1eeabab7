"""Cases shared by the CPU (gloo) and CUDA (NCCL) tests of the generators on sequence slices (a DiT's
blocks, a U-Net's transformer blocks): a two-block PixArt or the tiny U-Net run whole and sharded over
a TP group of two, compared layer by layer, the condition's gradient (what the output projector
before it receives) included."""

from __future__ import annotations

import torch
import torch._dynamo
from host_reads import host_reads
from torch._dynamo.testing import CompileCounterWithBackend
from tp_seq_cases import sharded_layers, worst_grad_error

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.dit.config import DiTConfig
from disttrain_ds.families.dit.model import dit_layers
from disttrain_ds.families.unet.config import GeneratorConfig
from disttrain_ds.families.unet.model import generator_layers
from disttrain_ds.models.compiled import compile_layers

COND, CROSS, CHANNELS = 5, 24, 4
"""Condition tokens per image, their width, and the generated image's channels."""
CASES = [("dit", 16, 3, 3, {}), ("dit", 12, 1, 3, {}), ("dit", 16, 4, 1, {}),
         ("unet", 16, 2, 3, {}), ("unet", 16, 3, 1, {"use_linear_projection": True})]
"""(family, resolution, chunks, images, config overrides): a DiT with 64 patch tokens (32 per slice) in
3 pieces; 36 (18 per slice) unchunked; one image, where the modulation table and ``t_mod`` have one
shape, so autograd hands both the same gradient tensor (a sum over TP made in place would change the
other's); the tiny U-Net (attention at 16 x 16 and 8 x 8: 256 and 64 tokens per image), its
projections as 1 x 1 convolutions (SD 1.x) and, on one image, as linears (SD 2.x)."""


def config(family: str, resolution: int, overrides: dict | None = None):
    """The cases' DiT (two blocks, 4 heads of 8, patch 2) or U-Net (the tiny preset's levels)."""
    if family == "dit":
        return DiTConfig(heads=4, head_dim=8, layers=2, cross_attention_dim=CROSS, resolution=resolution,
                         in_channels=CHANNELS, query_tokens=COND, **(overrides or {}))
    return GeneratorConfig(cross_attention_dim=CROSS, resolution=resolution, in_channels=CHANNELS, query_tokens=COND,
                           **(overrides or {}))


def generator_defs(family: str, resolution: int, overrides: dict | None = None):
    build = dit_layers if family == "dit" else generator_layers
    return build(config(family, resolution, overrides), BuildContext(module="generator", seed=3, llm_hidden=32))


def _run(layers, cond, noisy, timesteps, weight) -> tuple[torch.Tensor, torch.Tensor]:
    x = (cond, noisy, timesteps)
    for layer in layers:
        x = layer(x)
    return (x * weight).sum(), x


def generator_case(rank: int, group, family: str, resolution: int, chunks: int, images: int, overrides: dict,
                   hooks: bool = True, backend: str | None = None, device: str = "cpu") -> dict:
    """One rank's run: the sharded generator's loss, output and condition gradient against the whole
    model's, the worst parameter-gradient error (relative to the layer's largest gradient) and
    where; ``backend``: the second layer compiled with it, its graphs counted."""
    defs = generator_defs(family, resolution, overrides)
    g = torch.Generator().manual_seed(5)
    cond = torch.randn(images, COND, CROSS, generator=g).to(device)
    noisy = torch.randn(images, CHANNELS, resolution, resolution, generator=g).to(device)
    timesteps = torch.randint(0, 1000, (images,), generator=g).to(device)
    weight = torch.randn(images, CHANNELS, resolution, resolution, generator=g).to(device)

    ref = [d.build().to(device) for d in defs]
    ref_cond = cond.clone().requires_grad_()
    ref_loss, ref_out = _run(ref, ref_cond, noisy, timesteps, weight)
    ref_loss.backward()

    sharded = sharded_layers(defs, group, rank, chunks, hooks, device)
    between = sharded[1](sharded[0]((cond, noisy, timesteps)))[0]
    counter = None
    if backend is not None:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compile_layers(sharded[1:2], backend=counter)
    own_cond = cond.clone().requires_grad_()
    with host_reads() as reads:  # the step's hot path: nothing read back to the host
        loss, out = _run(sharded, own_cond, noisy, timesteps, weight)
        loss.backward()
        control = float(loss.detach())  # what the counter sees of one read

    worst, where = worst_grad_error(ref, sharded, defs, rank)
    share = sum(p.numel() for layer in sharded for p in layer.parameters()) / \
        sum(p.numel() for layer in ref for p in layer.parameters())
    cond_err = float((own_cond.grad - ref_cond.grad).abs().max() / ref_cond.grad.abs().max())
    return {"loss": control, "ref_loss": float(ref_loss.detach()),
            "out_err": float((out - ref_out).abs().max()), "between": tuple(between.shape),
            "contiguous": between.is_contiguous(), "grad_err": worst, "where": where, "cond_err": cond_err,
            "param_share": share, "host_reads": reads, "graphs": None if counter is None else counter.frame_count}

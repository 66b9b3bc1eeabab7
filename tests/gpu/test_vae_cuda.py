"""The frozen VAE on CUDA: batched bf16 latents against per-image fp32 latents on CPU, the generator
placement's collate on the GPU, and (printed, not asserted) per-image fp32 vs batched bf16 time at
SD 2.1's shape."""

from __future__ import annotations

import time

import pytest
import torch

from disttrain_ds.models.vae import LatentEncoder
from disttrain_ds.models.vae_config import CUDA_BATCH, VaeConfig

pytestmark = pytest.mark.gpu

TINY = VaeConfig(preset="tiny")


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _assert_near(a: torch.Tensor, b: torch.Tensor, tol: float, what: str):
    """Max difference within ``tol`` of the reference's largest value (bf16 has ~3 significant digits)."""
    diff, scale = (a.float().cpu() - b.float().cpu()).abs().max().item(), b.float().abs().max().item()
    assert scale > 0 and diff <= tol * scale, f"{what}: max |diff| {diff:.3g} over max |ref| {scale:.3g}"


def test_batched_bf16_latents_on_cuda_match_per_image_fp32_latents_on_cpu():
    _needs_cuda()
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, s, s, generator=g) * 2 - 1 for s in (64,) * 11 + (32,) * 3]
    images = images[:5] + images[11:] + images[5:11]  # sizes interleaved: grouping must keep the order
    gpu = LatentEncoder(TINY, 0, device="cuda", dtype=torch.bfloat16)
    assert gpu.batch == CUDA_BATCH and next(gpu.vae.parameters()).dtype == torch.bfloat16
    cpu = LatentEncoder(TINY, 0)
    out = gpu.many([im[None] for im in images])
    for i, (im, z) in enumerate(zip(images, out)):
        assert z.device.type == "cpu" and z.dtype == torch.float32 and z.shape == (1, 4, im.shape[1] // 2, im.shape[2] // 2)
        _assert_near(z, cpu(im[None]), 5e-2, f"image {i}")
    with pytest.raises(AssertionError):  # negative control: another image's latent is not within tolerance
        _assert_near(out[0], cpu(images[1][None]), 5e-2, "neighbour")


def test_generator_placement_collate_on_cuda_gives_bf16_latents_of_the_latent_shape():
    _needs_cuda()
    from disttrain_ds.data.registry import open_source, resolve
    from disttrain_ds.mllm.model import BatchNorms, collate
    from disttrain_ds.models.vae import generator_vae
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.setup import build_data_and_spec, shape_spec

    r = load_recipe("tiny_cpu_latent", ["model.generator.vae.placement=generator"])
    samples = open_source(resolve(r.data), shape_spec(r), 4, r.seed).global_batch(0)
    _, spec = build_data_and_spec(r)
    norms = BatchNorms.of(samples, 4)
    vae = generator_vae(spec, "cuda", torch.bfloat16)
    assert vae.device.type == "cuda" and vae.dtype == torch.bfloat16
    on_gpu = collate(samples, norms, spec, dtype=torch.bfloat16, vae=vae)
    on_cpu = collate(samples, norms, spec, vae=generator_vae(spec))
    n = sum(int(s.gen_targets[0].shape[0]) for s in samples)
    assert n > 0 and on_gpu.noisy.shape == (n, 4, 8, 8) and on_gpu.noisy.dtype == torch.bfloat16
    assert torch.equal(on_gpu.timesteps, on_cpu.timesteps)
    _assert_near(on_gpu.noisy, on_cpu.noisy, 5e-2, "noisy latents")


def test_print_per_image_fp32_vs_batched_bf16_encode_time_at_sd21_shape():
    """A figure for the log, not a benchmark (bench/gpu_vae.py is): 8 images of 256 px."""
    _needs_cuda()
    images = torch.rand(CUDA_BATCH, 3, 256, 256) * 2 - 1
    for label, dtype, batch in (("per image, fp32", torch.float32, 1), (f"batch {CUDA_BATCH}, bf16", torch.bfloat16, CUDA_BATCH)):
        enc = LatentEncoder(VaeConfig(preset="sd21", batch=batch), 0, device="cuda", dtype=dtype)
        enc(images)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            z = enc(images)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 3 / len(images) * 1e3
        print(f"\nSD 2.1 VAE encoder, 256 px, {label}: {ms:.2f} ms per image, host copies included "
              f"({torch.cuda.get_device_name()})")
        assert z.shape == (CUDA_BATCH, 4, 32, 32) and torch.isfinite(z).all()
        del enc

"""Batched VAE encoding: which images share an encoder call (equal sizes, bounded, order kept), its
latents against one image at a time (fp32 on CPU: ~1e-6), and the per-device default batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain_ds.models.vae import LatentEncoder, build_vae, encode, encode_images, size_batches
from disttrain_ds.models.vae_config import CUDA_BATCH, VaeConfig, vae_problem

TINY = VaeConfig(preset="tiny")


def _images(sides, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) * 2 - 1 for h, w in sides]


def test_size_batches_groups_equal_sizes_in_order_and_bounds_each_batch():
    shapes = [(3, 16, 16), (3, 8, 8), (3, 16, 16), (3, 16, 16), (3, 8, 8), (3, 16, 16), (3, 16, 16)]
    assert size_batches(shapes, 2) == [[0, 2], [3, 5], [6], [1, 4]]
    assert size_batches(shapes, 1) == [[i] for i in (0, 2, 3, 5, 6, 1, 4)]
    assert size_batches(shapes, 8) == [[0, 2, 3, 5, 6], [1, 4]]
    groups = size_batches(shapes, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(shapes)))  # each image exactly once
    assert all(len(g) <= 3 and len({shapes[i] for i in g}) == 1 for g in groups)
    assert size_batches([], 4) == []
    with pytest.raises(ValueError, match="batch"):
        size_batches(shapes, 0)


def test_batched_latents_equal_per_image_latents_in_fp32_on_cpu_and_keep_the_input_order():
    vae = build_vae(TINY, seed=0)
    images = _images([(16, 16), (8, 8), (16, 16), (16, 12), (16, 16), (8, 8), (16, 16)])
    alone = encode_images(vae, images, batch=1)
    together = encode_images(vae, images, batch=3)
    for im, a, b in zip(images, alone, together):
        assert a.shape == (4, im.shape[1] // 2, im.shape[2] // 2) and b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # Batch 1 is the single-image encoder call, bit for bit.
    assert torch.equal(alone[3], encode(vae, images[3][None])[0])
    # Negative control: a latent matched against its neighbour's is far off (order matters).
    assert (together[0] - alone[2]).abs().max() > 1e-2


def test_latent_encoder_default_batch_is_one_on_cpu_and_bounded_on_cuda():
    assert TINY.batch_on("cpu") == 1 and TINY.batch_on("cuda") == CUDA_BATCH
    four = dataclasses.replace(TINY, batch=4)
    assert four.batch_on("cpu") == 4 and four.batch_on("cuda") == 4
    enc = LatentEncoder(TINY, 0, dtype=torch.bfloat16)  # a bf16 run's CPU encoder stays fp32, per image
    assert (enc.batch, enc.dtype, next(enc.vae.parameters()).dtype) == (1, torch.float32, torch.float32)
    assert vae_problem(dataclasses.replace(TINY, batch=-1), 4)[0] == "batch"
    assert vae_problem(four, 4) is None


def test_many_encodes_every_samples_stack_together_like_each_alone():
    one = LatentEncoder(TINY, 0)
    four = LatentEncoder(dataclasses.replace(TINY, batch=4), 0)
    stacks = [torch.stack(_images([(16, 16)] * n, seed=n)) if n else torch.zeros(0, 3, 16, 16) for n in (3, 0, 2, 1)]
    per_sample = [one(st) for st in stacks]
    for enc, tol in ((one, 0.0), (four, 1e-6)):
        out = enc.many(stacks)
        assert [o.shape for o in out] == [(3, 4, 8, 8), (0, 4, 8, 8), (2, 4, 8, 8), (1, 4, 8, 8)]
        for a, b in zip(out, per_sample):
            torch.testing.assert_close(a, b, rtol=0, atol=tol)

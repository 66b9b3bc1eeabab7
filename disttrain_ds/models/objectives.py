"""The training objectives every family of a role shares: next-token loss, generation queries,
DDPM epsilon prediction with noise drawn identically in every layout."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from disttrain_ds.samples import IGNORE_INDEX


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Summed next-token cross-entropy times ``scale`` (label[i] is the target at position i;
    ``IGNORE_INDEX`` positions count nothing). Without a host sync: no test for labelled positions,
    no boolean indexing, so a step never waits here for the device (a microbatch without labels
    sums to 0, its gradient zeros)."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    return ce * scale


def gen_condition(hidden: torch.Tensor, gen_mask: torch.Tensor, query_tokens: int) -> torch.Tensor:
    """Hidden states at the generation-query positions, as [n_images, query_tokens, H]."""
    picked = hidden[gen_mask]
    if picked.shape[0] % query_tokens:
        raise ValueError(f"{picked.shape[0]} generation queries is not a multiple of {query_tokens}")
    return picked.view(-1, query_tokens, hidden.shape[-1])


def diffusion_loss(noise_pred: torch.Tensor, noise: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over images of the per-image mean squared error (epsilon prediction)."""
    per_image = F.mse_loss(noise_pred.float(), noise.float(), reduction="none").flatten(1).mean(1)
    return (per_image * weights).sum()


@functools.lru_cache(maxsize=4)
def scheduler(train_timesteps: int):
    """diffusers' DDPM noise schedule (``DDPMScheduler``)."""
    from diffusers import DDPMScheduler  # deferred: only generator ranks load diffusers

    return DDPMScheduler(num_train_timesteps=train_timesteps)


def noise_draw(shape: tuple[int, ...], sample_id: int, image_index: int, seed: int, train_timesteps: int):
    """Deterministic (timestep, noise) for one target of ``shape``: they depend on its shape only, so
    a stage that never sees the target (the loss stage behind a VAE) draws the same ones."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + sample_id * 101 + image_index) & 0x7FFFFFFFFFFFFFFF)
    noise = torch.randn(shape, generator=g)
    t = torch.randint(0, train_timesteps, (1,), generator=g)
    return t[0], noise


def add_noise(target: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, train_timesteps: int) -> torch.Tensor:
    """The DDPM forward process at timestep ``t``."""
    return scheduler(train_timesteps).add_noise(target.unsqueeze(0), noise.unsqueeze(0), t.view(1))[0]


def noise_sample(target: torch.Tensor, sample_id: int, image_index: int, seed: int, train_timesteps: int):
    """Deterministic (noisy, timestep, noise) for one target image, the same in every layout."""
    t, noise = noise_draw(tuple(target.shape), sample_id, image_index, seed, train_timesteps)
    return add_noise(target, t, noise, train_timesteps), t, noise

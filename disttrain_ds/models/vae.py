"""The frozen VAE: a diffusers ``AutoencoderKL`` built from a ``VaeConfig`` (seeded) or read from a
local ``save_pretrained`` directory, and the one function that turns RGB targets into latents."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..configtools import ConfigError
from .vae_config import VaeConfig, checkpoint_config

VAE_SEED_SALT = 0x5AE
"""Mixed into the run's seed for a VAE without a checkpoint (random init: benchmarks, tests)."""


def vae_kwargs(cfg: VaeConfig) -> dict:
    """``AutoencoderKL`` constructor arguments of a (resolved) config."""
    r = cfg.resolved()
    n = len(r.block_out_channels)
    return dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * n,
                up_block_types=["UpDecoderBlock2D"] * n, block_out_channels=list(r.block_out_channels),
                layers_per_block=r.layers_per_block, latent_channels=r.latent_channels,
                norm_num_groups=r.norm_num_groups, scaling_factor=r.scaling_factor)


@functools.lru_cache(maxsize=4)
def _load(path: str, key: str):
    from diffusers import AutoencoderKL

    checkpoint_config(path, key)
    try:
        return AutoencoderKL.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False)
    except Exception as exc:  # noqa: BLE001 - diffusers raises many types for broken folders
        raise ConfigError(f"{key}: {path}: cannot load AutoencoderKL weights "
                          f"({type(exc).__name__}: {exc})".splitlines()[0]) from None


def build_vae(cfg: VaeConfig, seed: int, key: str = "vae"):
    """The frozen (eval, no gradients) fp32 ``AutoencoderKL`` of ``cfg``: the checkpoint's weights, or
    seeded random ones of the config's shape (the same in every process)."""
    from diffusers import AutoencoderKL

    if cfg.checkpoint:
        vae = _load(str(Path(cfg.checkpoint).expanduser()), f"{key}.checkpoint")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((seed ^ VAE_SEED_SALT) & 0x7FFFFFFF)
            vae = AutoencoderKL(**vae_kwargs(cfg))
    vae = vae.float().eval().requires_grad_(False)
    vae.decoder = None  # only the encoder is ever run; the decoder's weights are not kept
    return vae


@torch.no_grad()
def encode(vae, images: torch.Tensor) -> torch.Tensor:
    """float32 [n, 3, H, W] in [-1, 1] -> latents [n, C, H / f, W / f]: the posterior mean times the
    scaling factor. One image at a time, so an image's latent does not depend on what it is
    batched with (convolution kernels may sum in another order for another batch size)."""
    out = []
    for img in images:
        h = vae.encoder(img.unsqueeze(0).float())
        if vae.quant_conv is not None:
            h = vae.quant_conv(h)
        mean = h[:, : h.shape[1] // 2]
        out.append(mean[0] * vae.config.scaling_factor)
    if not out:
        c = vae.config.latent_channels
        f = 2 ** (len(vae.config.block_out_channels) - 1)
        return images.new_zeros((0, c, images.shape[-2] // f, images.shape[-1] // f))
    return torch.stack(out)


class LatentEncoder:
    """A VAE built once per process, encoding one sample's targets at a time."""

    def __init__(self, cfg: VaeConfig, seed: int, key: str = "vae"):
        self.cfg = cfg.resolved()
        self.vae = build_vae(cfg, seed, key)
        self.channels = int(self.vae.config.latent_channels)
        self.downsample = 2 ** (len(self.vae.config.block_out_channels) - 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return encode(self.vae, images)


def generator_vae(spec) -> LatentEncoder | None:
    """The VAE the generator's first stage runs (``vae.placement: generator``), or None."""
    g = spec.generator
    vae = getattr(g, "vae", None)
    if vae is None or not vae.enabled or vae.placement != "generator":
        return None
    return LatentEncoder(vae, spec.seed, f"model.{spec.name_of('generator')}.vae")


def vae_memory_bytes(cfg: VaeConfig, side: int) -> tuple[float, float]:
    """(weight bytes, peak activation bytes) of the frozen fp32 encoder encoding one ``side`` px
    image under no_grad: the encoder's parameters (counted on the meta device), and three
    full-resolution maps of the first level's width alive at once (a ResNet block's input,
    normalised copy and output)."""
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(**vae_kwargs(cfg))
    params = sum(p.numel() for m in (vae.encoder, vae.quant_conv) if m is not None for p in m.parameters())
    return 4.0 * params, 3 * 4.0 * cfg.resolved().block_out_channels[0] * side * side

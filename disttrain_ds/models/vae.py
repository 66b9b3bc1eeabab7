"""The frozen VAE: a diffusers ``AutoencoderKL`` built from a ``VaeConfig`` (seeded) or read from a
local ``save_pretrained`` directory, and the one function that turns RGB targets into latents."""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.vae_config import VaeConfig, checkpoint_config

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


def size_batches(shapes: Sequence[tuple], batch: int) -> list[list[int]]:
    """Indices of images to encode together: equal shapes only, at most ``batch`` per group, each
    group in input order, groups in the order of their first image (a pure function of shapes)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    by_shape: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        by_shape.setdefault(tuple(shape), []).append(i)
    return [idx[j : j + batch] for idx in by_shape.values() for j in range(0, len(idx), batch)]


def _latents(vae, x: torch.Tensor) -> torch.Tensor:
    """[n, 3, H, W] -> [n, C, H / f, W / f]: the posterior mean times the scaling factor."""
    h = vae.encoder(x)
    if vae.quant_conv is not None:
        h = vae.quant_conv(h)
    return h[:, : h.shape[1] // 2] * vae.config.scaling_factor


def _empty(vae, images: torch.Tensor) -> torch.Tensor:
    c, f = vae.config.latent_channels, 2 ** (len(vae.config.block_out_channels) - 1)
    return images.new_zeros((0, c, images.shape[-2] // f, images.shape[-1] // f))


@torch.no_grad()
def encode_images(vae, images: Sequence[torch.Tensor], batch: int = 1) -> list[torch.Tensor]:
    """[3, H, W] images in [-1, 1] (any sizes, any device) -> their float32 latents, in order, on
    each image's device. Images of equal size go through the encoder ``batch`` at a time, on the
    VAE's device and in its dtype. ``batch`` 1 makes each latent independent of the others bit for
    bit (another batch size may sum convolutions in another order)."""
    p = next(vae.parameters())
    out: list[torch.Tensor | None] = [None] * len(images)
    for group in size_batches([im.shape for im in images], batch):
        x = torch.stack([images[i] for i in group]).to(p.device, p.dtype)
        lat = _latents(vae, x).float().to(images[group[0]].device)  # one copy back per batch
        for i, z in zip(group, lat):
            out[i] = z
    return out  # type: ignore[return-value]


def encode(vae, images: torch.Tensor, batch: int = 1) -> torch.Tensor:
    """float32 [n, 3, H, W] in [-1, 1] -> latents [n, C, H / f, W / f] (``encode_images``)."""
    if len(images) == 0:
        return _empty(vae, images)
    return torch.stack(encode_images(vae, list(images), batch))


class LatentEncoder:
    """A VAE built once per process on ``device``: fp32 on CPU; on CUDA in ``dtype`` (the run's
    compute dtype), ``cfg.batch_on(device)`` images of equal size per encoder call."""

    def __init__(self, cfg: VaeConfig, seed: int, key: str = "vae", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg = cfg.resolved()
        self.device = torch.device(device)
        self.dtype = dtype if self.device.type == "cuda" else torch.float32
        self.batch = cfg.batch_on(self.device.type)
        vae = build_vae(cfg, seed, key)
        if (self.device.type, self.dtype) != ("cpu", torch.float32):
            # A checkpoint's VAE is cached and shared: move a copy. nn.Module.to: diffusers' own
            # ``to`` warns on any dtype, though this VAE keeps no module in fp32.
            vae = torch.nn.Module.to(copy.deepcopy(vae), self.device, self.dtype)
        self.vae = vae
        self.channels = int(self.vae.config.latent_channels)
        self.downsample = 2 ** (len(self.vae.config.block_out_channels) - 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> float32 latents [n, C, H / f, W / f] on the images' device."""
        return encode(self.vae, images, self.batch)

    def many(self, stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Several [n_i, 3, H, W] stacks (one per sample) encoded together: equal-size images of
        different stacks share encoder calls. One float32 latent stack per input stack."""
        images = [im for st in stacks for im in st]
        flat = iter(encode_images(self.vae, images, self.batch))
        return [torch.stack([next(flat) for _ in range(len(st))]) if len(st) else _empty(self.vae, st)
                for st in stacks]


def generator_vae(spec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LatentEncoder | None:
    """The VAE the first generator's first stage runs (``vae.placement: generator``) on ``device``, or None."""
    first = spec.generators[0] if spec.generators else None
    vae = getattr(spec.config(first), "vae", None) if first else None
    if vae is None or not vae.enabled or vae.placement != "generator":
        return None
    return LatentEncoder(vae, spec.seed, f"model.{first}.vae", device, dtype)


def vae_memory_bytes(cfg: VaeConfig, side: int, batch: int = 1, elem_bytes: int = 4) -> tuple[float, float]:
    """(weight bytes, peak activation bytes) of the frozen encoder in ``elem_bytes`` per value
    encoding ``batch`` ``side`` px images under no_grad: the encoder's parameters (counted on the
    meta device), and three full-resolution maps of the first level's width per image alive at
    once (a ResNet block's input, normalised copy and output)."""
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(**vae_kwargs(cfg))
    params = sum(p.numel() for m in (vae.encoder, vae.quant_conv) if m is not None for p in m.parameters())
    return elem_bytes * params, 3 * elem_bytes * batch * cfg.resolved().block_out_channels[0] * side * side

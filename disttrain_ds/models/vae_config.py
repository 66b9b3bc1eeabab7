"""The frozen VAE a latent-space generator's targets go through (no torch: recipes read it).

A generator section names it as ``vae: {preset: sd21}`` (or ``{checkpoint: <save_pretrained dir>}``);
real images are then decoded, resized to the latent side times the VAE's downsampling factor and
encoded to latents, in the data producers or on the generator's ranks (``placement``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from disttrain_ds.errors import ConfigError

VAE_PRESETS: dict[str, dict] = {
    # Two levels of 8 and 16 channels, 4 latent channels, 2x downsampling: ~20 ms per 16 px image on one CPU core.
    "tiny": dict(block_out_channels=[8, 16], layers_per_block=1, latent_channels=4, norm_num_groups=4,
                 scaling_factor=0.5),
    # stabilityai/stable-diffusion-2-1 vae/config.json: 4 levels (128 / 256 / 512 / 512), 2 ResNet
    # blocks each, 4 latent channels, 8x downsampling, latents scaled by 0.18215 (~84M parameters).
    "sd21": dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=4, norm_num_groups=32,
                 scaling_factor=0.18215),
}

PLACEMENTS = ("producer", "generator")
CUDA_BATCH = 8
"""Images per encoder call on CUDA when ``batch`` is 0 (the batch of the H200 figure in docs/vae.md)."""


@dataclass
class VaeConfig:
    """A frozen diffusers ``AutoencoderKL`` whose encoder turns RGB generation targets into latents.

    The latent of an image is the posterior's mean times ``scaling_factor``: deterministic, so the
    same image gives the same latent in every layout and process (a sampled latent would need its
    own seeded noise per image, and adds nothing the diffusion noise does not already add).
    """

    preset: str = ""
    """Named shape (tiny | sd21); empty with no ``checkpoint``: no VAE (the generator reads its
    targets as they come). Fields given beside it override it."""
    checkpoint: str = ""
    """Local diffusers ``AutoencoderKL.save_pretrained`` directory (config.json + weights); its
    config is the VAE's shape. Never downloaded. Empty: seeded random init of the preset's shape."""
    placement: str = "generator"
    """Where images are encoded: producer (in the data producers on CPU; latents travel in the
    batches) | generator (on the generator's first pipeline stage, forward only; pixels travel)."""
    batch: int = 0
    """Images encoded together, at most (only images of equal size share a batch); 0: per device,
    1 on CPU (every latent bit for bit that of its image alone, whatever it is collated with) and
    8 on CUDA (batched, in the run's compute dtype: bf16 under ``train.dtype: bf16``). Any other
    value applies on both; on CPU in fp32 a batch changes latents by ~1e-7 (kernel summation order)."""
    block_out_channels: list[int] = field(default_factory=list)
    """Channels of each encoder level (empty: the preset's); ``2 ** (levels - 1)`` is the downsampling."""
    layers_per_block: int = 0
    """ResNet blocks per level (0: the preset's)."""
    latent_channels: int = 0
    """Channels of a latent (0: the preset's); must equal the generator's ``in_channels``."""
    norm_num_groups: int = 0
    """GroupNorm groups (0: the preset's)."""
    scaling_factor: float = 0.0
    """Latents are the posterior mean times this (0: the preset's; SD 2.1: 0.18215)."""

    @property
    def enabled(self) -> bool:
        return bool(self.preset or self.checkpoint)

    def resolved(self) -> "VaeConfig":
        """The preset's (or the checkpoint's config.json) values under the fields given."""
        if self.checkpoint:  # the directory's own shape
            c = checkpoint_config(self.checkpoint)
            base = {k: c[k] for k in VAE_PRESETS["sd21"] if k in c}
        else:
            base = VAE_PRESETS.get(self.preset, {})
        given = {k: v for k, v in (("block_out_channels", self.block_out_channels),
                                   ("layers_per_block", self.layers_per_block),
                                   ("latent_channels", self.latent_channels),
                                   ("norm_num_groups", self.norm_num_groups),
                                   ("scaling_factor", self.scaling_factor)) if v}
        return replace(self, **{**base, **given})

    def batch_on(self, device_type: str) -> int:
        """Images per encoder call on a ``device_type`` ("cpu", "cuda") device."""
        return self.batch or (CUDA_BATCH if device_type == "cuda" else 1)

    @property
    def downsample(self) -> int:
        """Pixels per latent pixel along each side."""
        return 2 ** (len(self.resolved().block_out_channels) - 1)


def vae_problem(cfg: VaeConfig, gen_channels: int) -> tuple[str, str] | None:
    """(field, message) of the first thing wrong with a generator's ``vae`` section, or None."""
    if not cfg.enabled:
        return None
    if cfg.preset and cfg.preset not in VAE_PRESETS:
        return "preset", f"must be one of {' | '.join(VAE_PRESETS)} (or empty), got {cfg.preset!r}"
    if cfg.batch < 0:
        return "batch", f"must be >= 0 (0: 1 on CPU, {CUDA_BATCH} on CUDA), got {cfg.batch}"
    if cfg.placement not in PLACEMENTS:
        return "placement", f"must be one of {' | '.join(PLACEMENTS)}, got {cfg.placement!r}"
    r = cfg.resolved()
    if not r.block_out_channels or any(c <= 0 or c % r.norm_num_groups for c in r.block_out_channels):
        return "block_out_channels", f"must be positive multiples of norm_num_groups {r.norm_num_groups}, got {r.block_out_channels}"
    if r.latent_channels != gen_channels and not cfg.checkpoint:
        return "latent_channels", f"{r.latent_channels} must equal the generator's in_channels {gen_channels}"
    if r.scaling_factor <= 0:
        return "scaling_factor", f"must be > 0, got {r.scaling_factor}"
    return None


def checkpoint_config(path: str, key: str = "vae.checkpoint") -> dict:
    """The config.json of a ``save_pretrained`` VAE directory; ConfigError naming ``path`` if it is not one."""
    p = Path(path).expanduser()
    cfg_file = p / "config.json"
    if not p.is_dir() or not cfg_file.is_file():
        raise ConfigError(f"{key}: {path} is not an AutoencoderKL save_pretrained directory (no config.json)")
    try:
        data = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {cfg_file} is not valid JSON ({exc})".splitlines()[0]) from None
    if not isinstance(data, dict) or data.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        got = data.get("_class_name") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{key}: {cfg_file} describes a {got}, not an AutoencoderKL")
    return data

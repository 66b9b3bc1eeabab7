"""Size config of the DiT generator family, with its named presets (no torch: recipes read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain_ds.models.configs import ProjectorConfig
from disttrain_ds.models.vae_config import VaeConfig


@dataclass
class DiTConfig:
    """Image generator (family dit: a diffusers ``PixArtTransformer2DModel`` split by block) after
    its MLP output projector. The role-level fields (from ``in_channels`` on) have the names and
    meanings of ``GeneratorConfig``'s, so the data path and objective treat both families alike."""

    family: str = "dit"
    """Model family (dit): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size (tiny | pixart-alpha-512); fields given beside it override it."""
    patch_size: int = 2
    """Square patch side in sample pixels (latent pixels for a latent model); one patch is one token."""
    heads: int = 2
    """Attention heads per block (diffusers' ``num_attention_heads``); the width is heads x head_dim."""
    head_dim: int = 8
    """Channels per head (diffusers' ``attention_head_dim``)."""
    layers: int = 2
    """Transformer blocks (diffusers' ``num_layers``); one pipeline layer each."""
    cross_attention_dim: int = 32
    """Width of the conditioning sequence the output projector produces; the blocks'
    cross-attention reads it directly (PixArt's caption projection is left out, see ``model.py``)."""
    learn_sigma: bool = False
    """Also predict the variance (out channels = 2 x in_channels, as PixArt-alpha checkpoints do),
    so such a checkpoint's ``proj_out`` loads; the head returns only the epsilon half."""
    in_channels: int = 3
    """Channels of the generated sample: 3 = pixel space (the runtime's data path)."""
    resolution: int = 16
    """Side of the generated sample in pixels (latent pixels for a latent model)."""
    query_tokens: int = 4
    """LLM positions (``gen`` tokens) whose hidden states condition one generated image."""
    train_timesteps: int = 1000
    """DDPM training timesteps (diffusers DDPMScheduler, epsilon prediction)."""
    frozen: bool = False
    """Keep the generator's own weights fixed; its projector follows ``projector.frozen``."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The output projector (LLM width -> ``cross_attention_dim``) before the generator's first layer."""
    checkpoint: str = ""
    """Local PixArt weights (.safetensors file or diffusers save_pretrained directory); empty: seeded random init."""
    vae: VaeConfig = field(default_factory=VaeConfig)
    """Frozen VAE that encodes RGB targets to this generator's latents (``models/vae_config.py``);
    unset: targets reach the generator as the data source makes them."""


DIT_PRESETS: dict[str, dict] = {
    # 2 blocks of width 16 on 64 tokens (16 x 16 pixels, patch 2): a few ms per step on one CPU core.
    "tiny": {},
    # diffusers PixArt-alpha config (PixArt-alpha/PixArt-XL-2-512x512, transformer/config.json):
    # 28 layers, 16 heads x 72 = 1152 wide, patch 2, 4 latent channels on 64 x 64 latents,
    # cross_attention_dim 1152, out_channels 8 (learned sigma). Its caption_channels 4096 (T5-XXL)
    # feed a caption projection that our output projector replaces: 605M parameters here against
    # the checkpoint's 611M.
    "pixart-alpha-512": dict(
        patch_size=2, heads=16, head_dim=72, layers=28, cross_attention_dim=1152, learn_sigma=True,
        in_channels=4, resolution=64,
        query_tokens=120,  # PixArt-alpha's T5 caption length (max 120 tokens)
    ),
}

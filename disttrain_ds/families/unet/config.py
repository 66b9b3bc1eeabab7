"""The U-Net generator's section (family ``unet``) and its named presets; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain_ds.models.configs import ProjectorConfig
from disttrain_ds.models.vae_config import VaeConfig


@dataclass
class GeneratorConfig:
    """Image generator (family unet: a diffusers UNet2DConditionModel) after its MLP output projector."""

    family: str = "unet"
    """Model family (unet): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size (tiny | sd21); fields given beside it override it."""
    block_out_channels: list[int] = field(default_factory=lambda: [16, 32])
    """Channels of each U-Net resolution level."""
    layers_per_block: int = 1
    """ResNet blocks per level."""
    down_block_types: list[str] = field(default_factory=lambda: ["CrossAttnDownBlock2D", "DownBlock2D"])
    """diffusers down block class names, one per level."""
    up_block_types: list[str] = field(default_factory=lambda: ["UpBlock2D", "CrossAttnUpBlock2D"])
    """diffusers up block class names, one per level."""
    attention_head_dim: list[int] = field(default_factory=lambda: [8, 8])
    """Attention head dimension per level (diffusers' naming)."""
    cross_attention_dim: int = 32
    """Width of the conditioning sequence the output projector produces."""
    norm_num_groups: int = 8
    """GroupNorm groups."""
    use_linear_projection: bool = False
    """Linear instead of 1x1-conv projections in transformer blocks (SD 2.x uses linear)."""
    upcast_attention: bool = False
    """Attention scores computed in fp32 under a lower-precision dtype (SD 2.1 sets it)."""
    in_channels: int = 3
    """Channels of the generated sample: 3 = pixel space; a latent space needs ``vae`` for real images."""
    resolution: int = 16
    """Side of the generated sample in pixels (latent pixels with a ``vae``)."""
    query_tokens: int = 4
    """LLM positions (``gen`` tokens) whose hidden states condition one generated image."""
    train_timesteps: int = 1000
    """DDPM training timesteps (diffusers DDPMScheduler, epsilon prediction)."""
    frozen: bool = False
    """Keep the generator's own weights fixed; its projector follows ``projector.frozen``."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The output projector (LLM width -> ``cross_attention_dim``) before the generator's first layer."""
    checkpoint: str = ""
    """Local U-Net weights (.safetensors file or save_pretrained directory); empty: seeded random init."""
    vae: VaeConfig = field(default_factory=VaeConfig)
    """Frozen VAE that encodes RGB targets to this generator's latents (``models/vae_config.py``);
    unset: targets reach the generator as the data source makes them."""


GENERATOR_PRESETS: dict[str, dict] = {
    "tiny": {},
    # stabilityai/stable-diffusion-2-1 unet/config.json (latent space: 4 channels, 96x96 latents).
    "sd21": dict(
        block_out_channels=[320, 640, 1280, 1280],
        layers_per_block=2,
        down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        attention_head_dim=[5, 10, 20, 20],
        cross_attention_dim=1024,
        norm_num_groups=32,
        use_linear_projection=True,
        in_channels=4,
        resolution=96,
        query_tokens=64,
    ),
}

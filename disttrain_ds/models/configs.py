"""Model size configs for the three modules, with named presets.

Presets cover a tiny CPU set (trains in seconds per step on 2 cores) and the paper's sizes:
ViT-Huge/14 (~632M), Llama backbones of the paper's model table (7B / 13B / 70B shapes) and a
Stable-Diffusion-2.1-like U-Net (~866M). A recipe names a preset and may override any field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from disttrain_ds.models.vae_config import VaeConfig


@dataclass
class ProjectorConfig:
    """The MLP that maps between an encoder or generator and the LLM (its own pipeline layer)."""

    frozen: bool = False
    """Keep the projector's weights fixed (independently of its module's ``frozen``)."""


@dataclass
class EncoderConfig:
    """Image encoder (family vit: transformers ViTModel layers) plus its MLP input projector."""

    family: str = "vit"
    """Model family (vit): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size this config starts from (tiny | vit-h-14); fields given beside it override it."""
    hidden_size: int = 32
    """ViT width."""
    layers: int = 2
    """Number of ViT transformer layers."""
    heads: int = 2
    """Attention heads per layer."""
    ffn_hidden: int = 64
    """ViT MLP inner width."""
    patch_size: int = 8
    """Square patch side in pixels; one patch becomes one LLM token."""
    image_size: int = 32
    """Side of the position-embedding grid in pixels; other resolutions are interpolated."""
    frozen: bool = False
    """Keep the encoder's own weights fixed (no weight gradients, no optimizer state); its
    projector follows ``projector.frozen``."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The input projector (encoder width -> LLM width) after the encoder's last layer."""
    checkpoint: str = ""
    """Local ViT weights (.safetensors file or save_pretrained directory); empty: seeded random init."""


@dataclass
class LLMConfig:
    """LLM backbone (family llama or qwen2: transformers decoder layers) with an LM head."""

    family: str = "llama"
    """Model family (llama | qwen2): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size (tiny | llama-7b | llama-13b | llama-70b | llama3.2-1b | llama3.2-3b); fields given
    beside it override it."""
    hidden_size: int = 64
    """Model width."""
    layers: int = 4
    """Number of decoder layers."""
    heads: int = 4
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention when below ``heads``)."""
    ffn_hidden: int = 128
    """SwiGLU inner width."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's size (base vocabulary plus special tokens)."""
    max_position: int = 8192
    """Largest position for rotary embeddings."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_type: Literal["default", "linear", "dynamic", "llama3", "yarn"] = "default"
    """RoPE variant as transformers names it (``rope_type``): plain, or a context-extension scaling
    whose parameters are ``rope_scaling`` (Llama 3.1+ checkpoints say llama3)."""
    rope_scaling: dict[str, int | float | bool] = field(default_factory=dict)
    """The scaling's parameters under transformers' names (``factor``, ``original_max_position_embeddings``,
    ``low_freq_factor``, ``high_freq_factor``, ``beta_fast``, ...); empty for the default RoPE."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (transformers' Llama default; Llama 2 and 3 checkpoints say 1e-5)."""
    head_dim: int = 0
    """Width of one attention head; 0: ``hidden_size / heads`` (a checkpoint's ``head_dim`` that
    differs is read into it: q and o projections are then ``heads * head_dim`` wide)."""
    attention_bias: bool = False
    """Biases on the q / k / v / o projections (Llama's ``attention_bias``; Qwen2's q / k / v biases
    are its family's own and need no field)."""
    mlp_bias: bool = False
    """Biases on the gate / up / down projections (Llama's ``mlp_bias``)."""
    tie_embeddings: bool = False
    """The LM head is the input embedding (transformers' ``tie_word_embeddings``: Llama 3.2 1B/3B,
    Qwen2.5 up to 3B, SmolLM2). One parameter where embedding and head share a pipeline stage;
    across stages each keeps a copy and their gradients are summed before every step. Under TP the
    embedding is then split by vocabulary rows like the head."""
    doc_attention: Literal["auto", "spans", "flex"] = "auto"
    """How attention stays inside each packed document (``models/doc_mask.py``): ``spans`` runs
    causal SDPA per document span, ``flex`` compiled flex attention with a block mask (CUDA only:
    no backward on CPU), ``auto`` flex on CUDA for microbatches that pack several documents (or a document
    and padding) in a row, spans otherwise. All three compute the same function."""
    frozen: bool = False
    """Keep the backbone's weights fixed (gradients still flow through to the encoders' projectors)."""
    checkpoint: str = ""
    """Local Llama weights (.safetensors file or save_pretrained directory); empty: seeded random init.
    A directory's ``config.json`` fixes the shapes and settings (fields left out of the recipe are
    read from it; one written differently is an error)."""


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


ENCODER_PRESETS: dict[str, dict] = {
    "tiny": {},
    # google/vit-huge-patch14-224-in21k: 32 layers, width 1280, 16 heads, MLP 5120.
    "vit-h-14": dict(hidden_size=1280, layers=32, heads=16, ffn_hidden=5120, patch_size=14, image_size=224),
}

_LLAMA32 = dict(rope_theta=500000.0, rope_type="llama3", max_position=131072, rms_norm_eps=1e-5, tie_embeddings=True,
                rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
"""What Llama 3.2 checkpoints share beyond their sizes."""

LLM_PRESETS: dict[str, dict] = {
    "tiny": {},
    # The paper's backbone table (disttrain_ds/paper/disttrain_paper.json: llm_backbones); vocab per family.
    "llama-7b": dict(hidden_size=4096, layers=32, heads=32, kv_heads=32, ffn_hidden=11008, vocab_size=32000),
    "llama-13b": dict(hidden_size=5120, layers=40, heads=40, kv_heads=40, ffn_hidden=13824, vocab_size=32000),
    "llama-70b": dict(
        hidden_size=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, vocab_size=128256, rope_theta=500000.0
    ),
    # meta-llama/Llama-3.2-1B and -3B config.json: tied embeddings, Llama 3.1 RoPE scaling, eps 1e-5.
    "llama3.2-1b": dict(hidden_size=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        **_LLAMA32),
    "llama3.2-3b": dict(hidden_size=3072, layers=28, heads=24, kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        **_LLAMA32),
}

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

PRESETS = {"encoder": ENCODER_PRESETS, "llm": LLM_PRESETS, "generator": GENERATOR_PRESETS}


def trains(cfg) -> bool:
    """Whether any weight of a module trains: its own layers, or its projector."""
    projector = getattr(cfg, "projector", None)
    return not cfg.frozen or (projector is not None and not projector.frozen)

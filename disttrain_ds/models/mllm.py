"""The whole multimodal LLM: the three modules' layer lists, microbatch tensors and losses.

Losses are normalised by global-batch totals (text tokens, generated images), not per microbatch,
so the loss of a global batch does not depend on how its samples are grouped into microbatches or
DP ranks: reordering samples inside a global batch leaves the loss and gradients unchanged, and
every layout (reference, monolithic, disaggregated) computes the same number.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from torch import nn

from ..data.types import IGNORE_INDEX, PackedSample, SpecialTokens
from ..families import BuildContext, Family, get_family
from ..families.whisper import rows as audio_rows
from .checkpoint import with_checkpoint
from .configs import EncoderConfig, GeneratorConfig, LLMConfig, trains
from .layers import LayerDef, Sequential, seeded
from .objectives import add_noise, diffusion_loss, gen_condition, noise_draw
from .packed import pack_clips
from .pixels import pack_images
from .projectors import ConditionProjector, InputProjector

MODULES = ("encoder", "llm", "generator")
"""The three-module graph's module names (each named after its role)."""


@dataclass
class MLLMSpec:
    """Everything needed to build the model's layers, identically on every rank."""

    encoder: EncoderConfig | None
    """The image encoder's section, or None in a graph without one."""
    llm: LLMConfig
    """Backbone sizes (vocab_size resolved)."""
    generator: GeneratorConfig | None
    """The generator's section, or None in a graph without one."""
    special: SpecialTokens
    """Token ids of image placeholders and generation queries."""
    seed: int
    """Initialisation seed shared by all layouts."""
    gen_loss_weight: float = 1.0
    """Weight of the diffusion loss relative to the LM loss."""
    roles: dict[str, str] = field(default_factory=lambda: dict(zip(MODULES, MODULES)))
    """Module name -> role, in data-flow order."""
    configs: dict = field(default_factory=dict)
    """Module name -> config section of the modules the role fields do not hold (an audio
    encoder, a second encoder); every other module takes its role's field."""

    @property
    def names(self) -> tuple[str, ...]:
        """Module names in data-flow order."""
        return tuple(self.roles)

    def name_of(self, role: str) -> str | None:
        """The module that has ``role``, or None."""
        return next((n for n, r in self.roles.items() if r == role), None)

    def config(self, module: str):
        if module not in self.roles:
            raise ValueError(f"unknown module {module!r}")
        if module in self.configs:
            return self.configs[module]
        return getattr(self, self.roles[module])

    @property
    def encoders(self) -> tuple[str, ...]:
        """Encoder module names in data-flow order (the order their rows enter the LLM)."""
        return tuple(n for n, r in self.roles.items() if r == "encoder")

    def modality(self, module: str) -> str:
        """What encoder ``module`` reads: image | audio."""
        return self.family(module).modality

    def encoder_of(self, modality: str):
        """The config of the encoder reading ``modality``, or None."""
        return next((self.config(n) for n in self.encoders if self.modality(n) == modality), None)

    def placeholders(self) -> tuple[int, ...]:
        """The placeholder token each encoder's rows fill in the LLM's input, encoder by encoder."""
        return tuple(self.special.placeholder(self.modality(n)) for n in self.encoders)

    def family(self, module: str) -> Family:
        return get_family(self.config(module).family, self.roles[module])

    def layers(self, module: str) -> list[LayerDef]:
        """The module's pipeline layers: its family's, with the projector on the LLM side."""
        fam, cfg = self.family(module), self.config(module)
        ctx = BuildContext(module=module, seed=self.seed, llm_hidden=self.llm.hidden_size, image_token=self.special.image,
                           placeholders=self.placeholders() if fam.role == "llm" else ())
        body = [replace(d, frozen=cfg.frozen) for d in fam.layers(cfg, ctx)]
        if fam.role != "llm":
            width, llm = fam.width(cfg), self.llm.hidden_size
            if fam.role == "encoder":
                proj = seeded(self.seed, module, "projector", lambda: InputProjector(width, llm))
                body = body + [replace(proj, frozen=cfg.projector.frozen)]
            else:
                proj = seeded(self.seed, module, "projector", lambda: ConditionProjector(llm, width))
                body = [replace(proj, frozen=cfg.projector.frozen)] + body
        return with_checkpoint(module, body, cfg.checkpoint, fam.hf_rules, fam.vocab_params)

    def frozen(self, module: str) -> bool:
        """Nothing in the module trains (neither its own layers nor its projector)."""
        return not trains(self.config(module))


@dataclass(frozen=True)
class BatchNorms:
    """Global-batch totals that make losses independent of microbatch grouping."""

    text_tokens: int
    """Labelled text positions in the whole global batch."""
    gen_images: int
    """Images to generate in the whole global batch."""
    chunks: int
    """LLM microbatches per global batch over all DP replicas (DP_llm * gradient accumulation)."""

    @staticmethod
    def of(samples: list[PackedSample], chunks: int) -> "BatchNorms":
        tokens = sum(int((s.labels != IGNORE_INDEX).sum()) for s in samples)
        gens = sum(int(s.gen_targets.shape[0]) for s in samples)
        return BatchNorms(max(tokens, 1), max(gens, 1), chunks)


@dataclass
class MicroBatch:
    """Tensors of one group of samples, split by the module that consumes them."""

    pixels: torch.Tensor
    """Encoder input: all images flattened and concatenated."""
    image_hw: torch.Tensor
    """int64 [n_images, 2]: (H, W) of each image."""
    input_ids: torch.Tensor
    """int64 [B, S]."""
    labels: torch.Tensor
    """int64 [B, S]; IGNORE_INDEX where no loss."""
    doc_ids: torch.Tensor
    """int64 [B, S]: each position's document in its packed sequence, ``NO_DOC`` on padding."""
    gen_mask: torch.Tensor
    """bool [B, S]: generation-query positions."""
    lm_scale: torch.Tensor
    """float scalar: multiplies the summed token cross-entropy (global normalisation)."""
    noisy: torch.Tensor
    """[n_gen, C, R, R] noisy targets."""
    timesteps: torch.Tensor
    """int64 [n_gen]."""
    noise: torch.Tensor
    """[n_gen, C, R, R] the noise to predict."""
    gen_weights: torch.Tensor
    """float [n_gen]: per-image weights of the diffusion loss."""
    sample_rows: dict
    """Per-sample row counts of the tensors that cross module boundaries (for DP splits):
    ``<modality>_embeds`` per encoder modality, ``gen_states``."""
    audio: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """Audio encoder input: all log-mel clips flattened and concatenated (``pack_clips``)."""
    audio_shapes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    """int64 [n_clips, 2]: (n_mels, frames) of each clip."""

    def encoder_inputs(self, modality: str) -> tuple:
        """The first-layer input of the encoder reading ``modality``."""
        return (self.pixels, self.image_hw) if modality == "image" else (self.audio, self.audio_shapes)


def collate(
    samples: list[PackedSample],
    norms: BatchNorms,
    spec: MLLMSpec,
    gen_dp_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    vae=None,
) -> MicroBatch:
    """Stack samples into module inputs; ``gen_dp_scale`` is DP_generator / DP_llm.

    Model inputs (pixels, noisy samples, target noise) take the compute ``dtype``; loss scales
    and weights stay float32. Without a generator the generation fields are empty. With the
    generator's VAE on its ranks (``vae.placement: generator``) targets arrive as RGB images:
    ``vae`` (a ``LatentEncoder``, given where the generator's first stage runs) encodes them to
    the latents that are noised; without it ``noisy`` stays empty and only the noise and
    timesteps (which depend on the latent shape alone) are drawn, for the loss stage."""
    images = [im for s in samples for im in s.images]
    pixels, hw = pack_images(images)
    noisy, ts, noise, weights = [], [], [], []
    g = spec.generator
    if g is not None:
        pixel_targets = getattr(g, "vae", None) is not None and g.vae.enabled and g.vae.placement == "generator"
        for s in samples:
            latents = vae(s.gen_targets) if pixel_targets and vae is not None else s.gen_targets
            for j, target in enumerate(latents):
                shape = (g.in_channels, g.resolution, g.resolution) if pixel_targets else tuple(target.shape)
                t, e = noise_draw(shape, s.sample_id, j, spec.seed, g.train_timesteps)
                if not pixel_targets or vae is not None:
                    noisy.append(add_noise(target, t, e, g.train_timesteps))
                ts.append(t)
                noise.append(e)
        w = spec.gen_loss_weight * gen_dp_scale * norms.chunks / norms.gen_images
        weights = [w] * len(noise)
        if not noise:
            # Nothing to generate in these samples: the generator still runs (its pipeline stages
            # and DP all-reduce must), on one all-zero stand-in whose loss weight is 0.
            c, r = g.in_channels, g.resolution
            noisy, ts, noise, weights = [torch.zeros(c, r, r)], [torch.tensor(0)], [torch.zeros(c, r, r)], [0.0]
    vit = spec.encoder_of("image")
    p = vit.patch_size if vit is not None else 1
    flat, shapes = pack_clips([c for s in samples for c in s.audio])
    wh = spec.encoder_of("audio")
    empty = torch.zeros(0)
    return MicroBatch(
        pixels=pixels.to(dtype),
        image_hw=hw,
        input_ids=torch.stack([s.input_ids for s in samples]),
        labels=torch.stack([s.labels for s in samples]),
        doc_ids=torch.stack([s.doc_ids() for s in samples]),
        gen_mask=torch.stack([s.input_ids == spec.special.gen for s in samples]),
        lm_scale=torch.tensor(norms.chunks / norms.text_tokens),
        noisy=torch.stack(noisy).to(dtype) if noisy else empty,
        timesteps=torch.stack(ts) if ts else empty.long(),
        noise=torch.stack(noise).to(dtype) if noise else empty,
        gen_weights=torch.tensor(weights, dtype=torch.float32),
        sample_rows={
            "image_embeds": [sum((im.shape[1] // p) * (im.shape[2] // p) for im in s.images) for s in samples],
            "gen_states": [int(s.gen_targets.shape[0]) for s in samples],
            "audio_embeds": [sum(audio_rows(wh, int(c.shape[1])) for c in s.audio) for s in samples],
        },
        audio=flat.to(dtype),
        audio_shapes=shapes,
    )


def llm_inputs(mb: MicroBatch, embeds: torch.Tensor | Sequence[torch.Tensor]) -> tuple:
    """The LLM's first-layer input tuple (``families/llama/model.py::LlmEmbed``): token ids, one row
    tensor per encoder (a single tensor: one encoder), each position's document."""
    rows = [embeds] if isinstance(embeds, torch.Tensor) else list(embeds)
    return (mb.input_ids, *rows, mb.doc_ids)


def generator_states(states: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The LLM states for the generator, or a zero stand-in when no image is to be generated."""
    if states.shape[0] == 0 and mb.noisy.shape[0] == 1:
        return states.new_zeros((1, *states.shape[1:]))
    return states


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy times ``scale`` (label[i] is the target at position i)."""
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()):
        return logits.sum() * 0.0
    ce = nn.functional.cross_entropy(logits[valid].float(), labels[valid], reduction="sum")
    return ce * scale


class ReferenceMLLM(nn.Module):
    """The monolithic model in one process: ground truth for every distributed layout."""

    def __init__(self, spec: MLLMSpec):
        super().__init__()
        self.spec = spec
        for name in spec.names:
            if hasattr(self, name):
                raise ValueError(f"module name {name!r} clashes with an attribute of the model")
            setattr(self, name, Sequential([build_layer(d) for d in spec.layers(name)]))

    def part(self, role: str) -> nn.Module | None:
        name = self.spec.name_of(role)
        return None if name is None else getattr(self, name)

    def forward(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        llm, generator = self.part("llm"), self.part("generator")
        embeds = [getattr(self, n)(mb.encoder_inputs(self.spec.modality(n))) for n in self.spec.encoders]
        if not embeds:  # no encoder: no placeholders to fill
            embeds = [torch.zeros(0, self.spec.llm.hidden_size, dtype=next(llm.parameters()).dtype)]
        logits, hidden = llm(llm_inputs(mb, embeds))
        lm = lm_loss_sum(logits, mb.labels, mb.lm_scale)
        gen = lm.new_zeros(())
        if generator is not None:
            states = generator_states(gen_condition(hidden, mb.gen_mask, self.spec.generator.query_tokens), mb)
            pred = generator((states, mb.noisy, mb.timesteps))
            gen = diffusion_loss(pred, mb.noise, mb.gen_weights)
        return {"loss": lm + gen, "lm": lm, "gen": gen}


def build_layer(d: LayerDef) -> nn.Module:
    """Build one layer; a frozen layer's weights get no gradients."""
    layer = d.build()
    if d.frozen:
        layer.requires_grad_(False)
    return layer


def module_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

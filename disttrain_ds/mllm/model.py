"""The whole multimodal LLM: every module's layer list, microbatch tensors and losses.

Losses are normalised by global-batch totals (text tokens, generated images), not per microbatch,
so the loss of a global batch does not depend on how its samples are grouped into microbatches or
DP ranks: reordering samples inside a global batch leaves the loss and gradients unchanged, and
every layout (reference, monolithic, disaggregated) computes the same number.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from torch import nn

from disttrain_ds.families import FAMILIES, BuildContext, Family, get_family
from disttrain_ds.mllm.weights import StepDirs, with_checkpoint
from disttrain_ds.models.configs import trains
from disttrain_ds.models.layers import LayerDef, Sequential, seeded, tie_parameters, tied_keys
from disttrain_ds.models.objectives import add_noise, diffusion_loss, gen_condition, lm_loss_sum, noise_draw
from disttrain_ds.models.packed import pack_clips
from disttrain_ds.models.pixels import pack_images
from disttrain_ds.models.projectors import ConditionProjector, InputProjector
from disttrain_ds.samples import IGNORE_INDEX, NO_DOC, PackedSample, SpecialTokens


@dataclass
class MLLMSpec:
    """Everything needed to build the model's layers, identically on every rank."""

    configs: dict[str, Any]
    """Module name -> its config section (its family's ``config_type``; the LLM's with vocab_size
    resolved), in data-flow order: encoders, the LLM, generators."""
    roles: dict[str, str]
    """Module name -> role (encoder | llm | generator), the same keys in the same order."""
    special: SpecialTokens
    """Token ids of image placeholders and generation queries."""
    seed: int
    """Initialisation seed shared by all layouts."""
    gen_loss_weight: float = 1.0
    """Weight of the diffusion loss relative to the LM loss."""
    step_dirs: StepDirs | None = None
    """How to read a ``model.<module>.checkpoint`` that is a training step directory, handed in by
    the builder (``checkpoint/read.py::STEP_DIRS``); None: safetensors files only."""

    def __post_init__(self) -> None:
        if list(self.configs) != list(self.roles):
            raise ValueError(f"configs {list(self.configs)} and roles {list(self.roles)} must name the same modules in order")
        if list(self.roles.values()).count("llm") != 1:
            raise ValueError(f"a model has exactly one LLM, got roles {self.roles}")

    @property
    def names(self) -> tuple[str, ...]:
        """Module names in data-flow order."""
        return tuple(self.roles)

    def name_of(self, role: str) -> str | None:
        """The module that has ``role``, or None."""
        return next((n for n, r in self.roles.items() if r == role), None)

    def config(self, module: str) -> Any:
        if module not in self.configs:
            raise ValueError(f"unknown module {module!r}")
        return self.configs[module]

    def with_changes(self, module: str, **changes: Any) -> "MLLMSpec":
        """This spec with ``changes`` made to ``module``'s config section."""
        return replace(self, configs={**self.configs, module: replace(self.config(module), **changes)})

    @property
    def llm(self) -> Any:
        """The LLM's config section (every graph has exactly one LLM)."""
        return self.configs[self.name_of("llm")]

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

    @property
    def generators(self) -> tuple[str, ...]:
        """Generator module names in graph order: the ``k``-th reads the states at the positions of
        ``special.query(k)`` and trains on each sample's ``targets(k)``."""
        return tuple(n for n, r in self.roles.items() if r == "generator")

    def gen_index(self, module: str) -> int:
        """Which generator ``module`` is (graph order): its query token and targets."""
        return self.generators.index(module)

    def gen_rows_key(self, module: str) -> str:
        """``MicroBatch.sample_rows`` key of the LLM states ``module`` reads (one row per target image)."""
        return f"gen_states/{module}"

    def placeholders(self) -> tuple[int, ...]:
        """The placeholder token each encoder's rows fill in the LLM's input, encoder by encoder."""
        return tuple(self.special.placeholder(self.modality(n)) for n in self.encoders)

    def family(self, module: str) -> Family:
        return get_family(self.config(module).family, self.roles[module])

    def rows_of_items(self, module: str, sample) -> list[int]:
        """Rows (LLM tokens) each item of ``sample`` makes in encoder ``module``."""
        fam, cfg = self.family(module), self.config(module)
        return [fam.rows(cfg, fam.item_size(cfg, t)) for t in sample.inputs(fam.modality)]

    def item_rows(self, module: str, sample) -> int:
        """Rows (LLM tokens) the items of ``sample`` make in encoder ``module``: what it sends the
        LLM, and about what its sequence-parallel all-to-alls carry."""
        return sum(self.rows_of_items(module, sample))

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
        return with_checkpoint(module, body, cfg.checkpoint, fam.hf_rules, fam.vocab_params, self.step_dirs)

    def tied_modules(self) -> frozenset[str]:
        """Modules with a weight shared by two of their layers (tied input and output embeddings)."""
        return frozenset(n for n in self.names if tied_keys(self.layers(n)))

    def frozen(self, module: str) -> bool:
        """Nothing in the module trains (neither its own layers nor its projector)."""
        return not trains(self.config(module))


@dataclass(frozen=True)
class BatchNorms:
    """Global-batch totals that make losses independent of microbatch grouping."""

    text_tokens: int
    """Labelled text positions in the whole global batch."""
    chunks: int
    """LLM microbatches per global batch over all DP replicas (DP_llm * gradient accumulation)."""
    gen_images: tuple[int, ...] = ()
    """Images each generator (graph order) produces in the whole global batch, at least 1: each
    generator's loss is a mean over its own images."""

    @staticmethod
    def counts(samples: list[PackedSample], generators: int) -> tuple[int, ...]:
        """(labelled text positions, then images to generate per generator) of ``samples``: summed
        over a whole global batch (here, or over the hosts that each read part of it) they give the norms."""
        tokens = sum(int((s.labels != IGNORE_INDEX).sum()) for s in samples)
        gens = [sum(_count(s.targets(k)) for s in samples) for k in range(max(generators, 1))]
        return (tokens, *gens)

    @staticmethod
    def of_counts(counts: Sequence[int], chunks: int) -> "BatchNorms":
        tokens, *gens = counts
        return BatchNorms(max(tokens, 1), chunks, tuple(max(n, 1) for n in gens))

    @staticmethod
    def of(samples: list[PackedSample], chunks: int, generators: int | None = None) -> "BatchNorms":
        """``generators``: how many the model has (None: as many as the samples hold targets for)."""
        if generators is None:
            generators = max((len(s.gen_targets) for s in samples), default=0)
        return BatchNorms.of_counts(BatchNorms.counts(samples, generators), chunks)

    def images(self, k: int) -> int:
        """Images the ``k``-th generator produces in the global batch (at least 1)."""
        return self.gen_images[k] if 0 <= k < len(self.gen_images) else 1


def _count(targets: torch.Tensor | None) -> int:
    return 0 if targets is None else int(targets.shape[0])


@dataclass
class GenInputs:
    """One generator's part of a microbatch."""

    mask: torch.Tensor
    """bool [B, S]: the positions of this generator's query token."""
    noisy: torch.Tensor
    """[n_gen, C, R, R] noisy targets."""
    timesteps: torch.Tensor
    """int64 [n_gen]."""
    noise: torch.Tensor
    """[n_gen, C, R, R] the noise to predict."""
    weights: torch.Tensor
    """float [n_gen]: per-image weights of the diffusion loss."""

    @staticmethod
    def of(samples: list[PackedSample], chunks: int) -> "BatchNorms":
        return BatchNorms.of_counts(*BatchNorms.counts(samples), chunks)


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
    lm_scale: torch.Tensor
    """float scalar: multiplies the summed token cross-entropy (global normalisation)."""
    gens: dict
    """Generator module name -> its ``GenInputs`` (empty without a generator)."""
    sample_rows: dict
    """Row counts of the tensors that cross module boundaries (for DP splits): ``<modality>_embeds``
    per item (image, clip) of every sample in order, ``MLLMSpec.gen_rows_key`` per target image (1 each)."""
    audio: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """Audio encoder input: all log-mel clips flattened and concatenated (``pack_clips``)."""
    audio_shapes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    """int64 [n_clips, 2]: (n_mels, frames) of each clip."""

    def encoder_inputs(self, modality: str) -> tuple:
        """The first-layer input of the encoder reading ``modality``."""
        return (self.pixels, self.image_hw) if modality == "image" else (self.audio, self.audio_shapes)


def gen_inputs(samples: list[PackedSample], norms: BatchNorms, spec: MLLMSpec, module: str, dp_scale: float,
               dtype: torch.dtype, vae=None) -> GenInputs:
    """Generator ``module``'s inputs: its query positions, and noisy targets with their noise drawn
    per (sample, target) as in every layout; ``dp_scale`` is DP_generator / DP_llm.

    With the generator's VAE on its ranks (``vae.placement: generator``) targets arrive as RGB
    images: ``vae`` (a ``LatentEncoder``, given where the generator's first stage runs) encodes them
    to the latents that are noised; without it ``noisy`` stays empty and only the noise and
    timesteps (which depend on the latent shape alone) are drawn, for the loss stage."""
    k, g = spec.gen_index(module), spec.config(module)
    pixel_targets = getattr(g, "vae", None) is not None and g.vae.enabled and g.vae.placement == "generator"
    noisy, ts, noise = [], [], []
    present = [t for s in samples if (t := s.targets(k)) is not None]
    # Every sample's images in one call: equal-size images of different samples share encoder batches.
    encoded = iter(vae.many(present) if pixel_targets and vae is not None else present)
    for s in samples:
        targets = s.targets(k)
        if targets is None:
            continue
        latents = next(encoded)
        for j, target in zip(s.target_ids(k), latents):
            shape = (g.in_channels, g.resolution, g.resolution) if pixel_targets else tuple(target.shape)
            # The first generator keeps its historical noise index; the others get their own stream.
            t, e = noise_draw(shape, s.sample_id, j + (k << 20), spec.seed, g.train_timesteps)
            if not pixel_targets or vae is not None:
                noisy.append(add_noise(target, t, e, g.train_timesteps))
            ts.append(t)
            noise.append(e)
    w = spec.gen_loss_weight * dp_scale * norms.chunks / norms.images(k)
    weights = [w] * len(noise)
    if not noise:
        # Nothing to generate in these samples: the generator still runs (its pipeline stages
        # and DP all-reduce must), on one all-zero stand-in whose loss weight is 0.
        c, r = g.in_channels, g.resolution
        noisy, ts, noise, weights = [torch.zeros(c, r, r)], [torch.tensor(0)], [torch.zeros(c, r, r)], [0.0]
    return GenInputs(
        mask=padded_rows([s.input_ids == spec.special.query(k) for s in samples], False),
        noisy=torch.stack(noisy).to(dtype) if noisy else torch.zeros(0, dtype=dtype),
        timesteps=torch.stack(ts), noise=torch.stack(noise).to(dtype),
        weights=torch.tensor(weights, dtype=torch.float32),
    )


def padded_rows(rows: Sequence[torch.Tensor], fill) -> torch.Tensor:
    """1-D rows stacked, the shorter ones padded at the end with ``fill`` (sequences of their own
    lengths, ``data.max_seq_len``: padding is a run of its own, which nothing attends to)."""
    n = max(int(r.shape[0]) for r in rows)
    if all(int(r.shape[0]) == n for r in rows):
        return torch.stack(list(rows))
    out = torch.full((len(rows), n), fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def collate(
    samples: list[PackedSample],
    norms: BatchNorms,
    spec: MLLMSpec,
    gen_dp_scale: float | dict[str, float] = 1.0,
    dtype: torch.dtype = torch.float32,
    vae=None,
) -> MicroBatch:
    """Stack samples into module inputs; ``gen_dp_scale`` is DP_generator / DP_llm (one number for
    every generator, or one per generator name).

    Model inputs (pixels, noisy samples, target noise) take the compute ``dtype``; loss scales
    and weights stay float32. Without a generator ``gens`` is empty. ``vae``: the first generator's
    frozen VAE where it runs on the generator's ranks (``gen_inputs``)."""
    images = [im for s in samples for im in s.images]
    pixels, hw = pack_images(images)
    scales = gen_dp_scale if isinstance(gen_dp_scale, dict) else {n: gen_dp_scale for n in spec.generators}
    gens = {n: gen_inputs(samples, norms, spec, n, scales[n], dtype, vae if spec.gen_index(n) == 0 else None)
            for n in spec.generators}
    # One row per target image: a boundary may carry each target on its own.
    gen_rows = {spec.gen_rows_key(n): [1] * sum(_count(s.targets(spec.gen_index(n))) for s in samples)
                for n in spec.generators}
    vit = spec.encoder_of("image")
    p = vit.patch_size if vit is not None else 1
    flat, shapes = pack_clips([c for s in samples for c in s.audio])
    ear = spec.encoder_of("audio")
    rows = FAMILIES[ear.family].rows if ear is not None else None  # output rows of one clip, by its family
    return MicroBatch(
        pixels=pixels.to(dtype),
        image_hw=hw,
        input_ids=padded_rows([s.input_ids for s in samples], spec.special.pad),
        labels=padded_rows([s.labels for s in samples], IGNORE_INDEX),
        doc_ids=padded_rows([s.doc_ids() for s in samples], NO_DOC),
        lm_scale=torch.tensor(norms.chunks / norms.text_tokens),
        gens=gens,
        sample_rows={
            # Encoders' rows per item (image, clip) in sample order: a boundary may carry each item on its own.
            "image_embeds": [(im.shape[1] // p) * (im.shape[2] // p) for im in images],
            **gen_rows,
            "audio_embeds": [rows(ear, int(c.shape[1])) for s in samples for c in s.audio],
        },
        audio=flat.to(dtype),
        audio_shapes=shapes,
    )


def llm_inputs(mb: MicroBatch, embeds: torch.Tensor | Sequence[torch.Tensor]) -> tuple:
    """The LLM's first-layer input tuple (``families/llama/model.py::LlmEmbed``): token ids, one row
    tensor per encoder (a single tensor: one encoder), each position's document."""
    rows = [embeds] if isinstance(embeds, torch.Tensor) else list(embeds)
    return (mb.input_ids, *rows, mb.doc_ids)


def generator_states(states: torch.Tensor, mb: MicroBatch, module: str) -> torch.Tensor:
    """The LLM states for generator ``module``, or a zero stand-in when it has no image to generate."""
    noisy = mb.gens[module].noisy
    if states.shape[0] == 0 and noisy.shape[0] == 1:
        return states.new_zeros((1, *states.shape[1:]))
    return states


def gen_states(hidden: torch.Tensor, mb: MicroBatch, spec: MLLMSpec) -> list[torch.Tensor]:
    """The LLM's hidden states at each generator's own query positions, one tensor per generator
    (graph order), ``[n_images, query_tokens, H]``: what each generator is sent."""
    return [gen_condition(hidden, mb.gens[n].mask, spec.config(n).query_tokens) for n in spec.generators]


class ReferenceMLLM(nn.Module):
    """The monolithic model in one process: ground truth for every distributed layout."""

    def __init__(self, spec: MLLMSpec):
        super().__init__()
        self.spec = spec
        for name in spec.names:
            if hasattr(self, name):
                raise ValueError(f"module name {name!r} clashes with an attribute of the model")
            defs = spec.layers(name)
            built = {d.name: build_layer(d) for d in defs}
            tie_parameters(built, defs)  # all layers here: every tie is one parameter
            setattr(self, name, Sequential(list(built.values())))

    def part(self, role: str) -> nn.Module | None:
        name = self.spec.name_of(role)
        return None if name is None else getattr(self, name)

    def forward(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """``loss``, ``lm``, ``gen`` (every generator's) and ``gen/<name>`` per generator."""
        llm = self.part("llm")
        embeds = [getattr(self, n)(mb.encoder_inputs(self.spec.modality(n))) for n in self.spec.encoders]
        if not embeds:  # no encoder: no placeholders to fill
            embeds = [torch.zeros(0, self.spec.llm.hidden_size, dtype=next(llm.parameters()).dtype)]
        logits, hidden = llm(llm_inputs(mb, embeds))
        lm = lm_loss_sum(logits, mb.labels, mb.lm_scale)
        out = {}
        for name, states in zip(self.spec.generators, gen_states(hidden, mb, self.spec)):
            g = mb.gens[name]
            pred = getattr(self, name)((generator_states(states, mb, name), g.noisy, g.timesteps))
            out[f"gen/{name}"] = diffusion_loss(pred, g.noise, g.weights)
        gen = sum(out.values(), lm.new_zeros(()))
        return {"loss": lm + gen, "lm": lm, "gen": gen, **out}


def build_layer(d: LayerDef) -> nn.Module:
    """Build one layer; a frozen layer's weights get no gradients."""
    layer = d.build()
    if d.frozen:
        layer.requires_grad_(False)
    return layer


def module_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

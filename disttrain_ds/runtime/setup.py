"""Pieces every layout builds the same way: model spec, data source, optimizer, schedule."""

from __future__ import annotations

import dataclasses
import math

import torch

from disttrain_ds.checkpoint.read import STEP_DIRS
from disttrain_ds.cost.dims import TransformerDims
from disttrain_ds.cost.graph_costs import GraphCosts
from disttrain_ds.cost.model import CostModel, UNetDims
from disttrain_ds.data.config import longest_seq
from disttrain_ds.data.host_read import slot_columns
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.registry import open_source, resolve
from disttrain_ds.data.source import SampleSource
from disttrain_ds.data.split import Split
from disttrain_ds.estimate.activations import sample_shape
from disttrain_ds.families import default_config
from disttrain_ds.mllm.model import MLLMSpec
from disttrain_ds.mllm.recipe_spec import recipe_spec
from disttrain_ds.recipe.graph import encoder_of, graph_of, module_family
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.reorder.sp_groups import SPCost, item_cost, transformer_cost
from disttrain_ds.samples import GenShape, ShapeSpec


def cost_model(recipe: Recipe) -> GraphCosts:
    """Per-sample cost of each module of the recipe's graph, by name (forward FLOPs), for
    reordering, balance, emulation and the profiler's draws: the LLM by its shape, every encoder
    and generator by its own family's cost terms."""
    graph, l = graph_of(recipe), recipe.model.llm
    model = CostModel.from_dims(
        TransformerDims(layers=1, hidden=1, ffn_hidden=1, heads=1),  # every encoder has its own terms below
        TransformerDims(
            layers=l.layers, hidden=l.hidden_size, ffn_hidden=l.ffn_hidden, heads=l.heads, kv_heads=l.kv_heads,
            gated_mlp=True, head_dim=l.head_dim,
        ),
        UNetDims(channels=(1,), attention=(False,)),  # every generator has its own terms below
        vocab_size=l.vocab_size or 32000,  # the LM head is the same per token for every sample
    )
    own, vae = {}, gen_vae(recipe)
    for n in (*graph.encoders, *graph.generators):
        terms = module_family(recipe, n).cost_terms(recipe.model.modules[n])
        if vae is not None and vae.placement == "generator" and n == graph.generators[0]:
            # Targets that travel as pixels (the VAE on the generator's ranks) are that many pixels per latent pixel.
            terms = {**terms, "gen_downsample": terms["gen_downsample"] * vae.downsample}
        own[n] = dataclasses.replace(model, **terms)
    kinds = {n: ("audio" if graph.role(n) == "encoder" and module_family(recipe, n).modality == "audio"
                 else graph.role(n)) for n in graph.names}
    return GraphCosts(model, kinds, own)


def generator_configs(recipe: Recipe) -> list:
    """Every generator's config section, in graph order."""
    return [recipe.model.modules[n] for n in graph_of(recipe).generators]


def first_generator(recipe: Recipe):
    """The first generator's section (its targets are ``gen_targets[0]``, its queries ``gen``), or None."""
    return next(iter(generator_configs(recipe)), None)


def gen_vae(recipe: Recipe):
    """The first generator's VAE config (``VaeConfig``), or None without a generator or a VAE."""
    vae = getattr(first_generator(recipe), "vae", None)
    return vae if vae is not None and vae.enabled else None


def reorder_groups(recipe: Recipe) -> int:
    """Groups per microbatch slot that balancing works on: every module's DP block is a union of them."""
    llm_dp = recipe.parallel.llm.dp
    slot = llm_dp * recipe.train.micro_batch
    if recipe.layout == "monolithic":  # every module shares the LLM's DP there
        return llm_dp
    groups = math.lcm(*(mp.dp for mp in recipe.parallel.modules.values()))
    return groups if slot % groups == 0 else llm_dp


def shape_spec(recipe: Recipe) -> ShapeSpec:
    """The model facts the recipe's sample source lays samples out by."""
    groups = reorder_groups(recipe)
    # Stand-ins where the graph has no image encoder or generator: no images / targets reach them.
    e = encoder_of(recipe, "image") or default_config("encoder")
    audio = encoder_of(recipe, "audio")
    vae = gen_vae(recipe)
    gens = [GenShape(c.resolution, c.in_channels, c.query_tokens, n)
            for n, c in zip(graph_of(recipe).generators, generator_configs(recipe))]
    if vae is not None:  # the VAE reads RGB images f times larger than the first generator's latents
        gens[0] = dataclasses.replace(gens[0], resolution=gens[0].resolution * vae.downsample, channels=3)
    if not gens:
        g = default_config("generator")
        gens = [GenShape(g.resolution, g.in_channels, g.query_tokens)]
    return ShapeSpec(
        patch_size=e.patch_size,
        gens=tuple(gens),
        audio_mels=audio.n_mels if audio is not None else 0,
        audio_max_frames=audio.max_frames if audio is not None else 0,
        vae=vae if vae is not None and vae.placement == "producer" else None,
        dp_size=groups,
        micro_batch=recipe.parallel.llm.dp * recipe.train.micro_batch // groups,
        cost_model=cost_model(recipe),
        columns=slot_columns([m.dp for m in recipe.parallel.modules.values()]),
    )


def build_data_and_spec(recipe: Recipe) -> tuple[SampleSource, MLLMSpec]:
    """The training sample source (less any held-out records) and the model spec (LLM vocabulary
    sized from the tokenizer)."""
    split = Split(fraction=recipe.eval.holdout_fraction)
    source = build_source(recipe.data, shape_spec(recipe), recipe.train.global_batch, recipe.seed, split)
    need = source.special.vocab_size
    vocab = recipe.model.llm.vocab_size or need
    if vocab < need:
        raise ValueError(f"model.llm.vocab_size {vocab} is smaller than the tokenizer's {need} ids")
    spec = recipe_spec(recipe, source.special, vocab, step_dirs=STEP_DIRS)  # a checkpoint may be a step directory
    return source, spec


def build_eval_source(recipe: Recipe) -> SampleSource:
    """The held-out split (``data/split.py``), read in-process: evaluation batches ``0 ..
    eval.batches - 1``, each one global batch, never overlapping the training stream."""
    cfg = dataclasses.replace(recipe.data, producers=0, reorder=False)  # a few batches: no processes
    split = Split(held_out=True, fraction=recipe.eval.holdout_fraction)
    return open_source(resolve(cfg), shape_spec(recipe), recipe.train.global_batch, recipe.seed, split)


def grad_accum_steps(recipe: Recipe) -> int:
    return recipe.train.global_batch // (recipe.parallel.llm.dp * recipe.train.micro_batch)


def lr_lambda(recipe: Recipe):
    """Multiplier of ``optim.lr`` at each optimizer step (linear warm-up, then constant or cosine)."""
    o, steps = recipe.optim, recipe.train.steps

    def f(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "cosine":
            span = max(1, steps - o.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - o.warmup_steps) / span)))
        return 1.0

    return f


def module_lr(recipe: Recipe, module: str, layer: str = "") -> float:
    """Peak learning rate of ``module``'s layer ``layer`` (``optim.module_lr``, else ``optim.lr``)."""
    rates = recipe.optim.module_lr
    own = rates.get(module, recipe.optim.lr)
    return rates.get(f"{module}/projector", own) if layer == "projector" else own


def param_groups(recipe: Recipe, module: str, layers) -> list[dict]:
    """Optimizer parameter groups of ``(layer name, nn.Module)`` pairs of one module: one group
    per distinct peak rate (the projector may have its own). A weight two layers share (tied
    embeddings) is listed once, with its first layer: an optimizer steps each parameter once."""
    groups: dict[float, list] = {}
    seen: set[int] = set()
    for name, layer in layers:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        groups.setdefault(module_lr(recipe, module, name), []).extend(fresh)
    return [{"params": ps, "lr": lr} for lr, ps in groups.items()]


def build_optimizer(recipe: Recipe, groups: list[dict]) -> torch.optim.Optimizer:
    """A torch optimizer (DeepSpeed accepts it as is; no fused-op compilation) over parameter
    groups (``param_groups``); frozen parameters are left out."""
    o = recipe.optim
    params = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    params = [g for g in params if g["params"]]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def sp_cost(recipe: Recipe, spec, module: str, per_node: int) -> SPCost:
    """How SP (adaptive groups, emulated compute) prices ``module``'s sequences: FLOPs at
    ``train.peak_tflops`` (400 when unset: only ratios matter), all-to-alls at
    ``parallel.sp_bandwidth_gbs`` (a group of more than ``per_node`` ranks crosses nodes), and as
    many tokens per GPU as the memory check allows: ``train.micro_batch`` sequences of
    ``data.max_seq_len`` for the LLM; for an encoder, whose sequences are its items, its share of a
    microbatch slot's samples, each with the most rows the data allows (``estimate.activations``)."""
    mp = recipe.parallel.modules[module]
    inside, across = recipe.parallel.sp_bandwidth_gbs
    top = mp.dp if mp.sp == "auto" else mp.sp  # the largest group
    sizes = [1 << k for k in range(1, top.bit_length())]
    bandwidth = {p: inside if p * mp.tp <= per_node else across for p in sizes} or {1: inside}
    tflops = recipe.train.peak_tflops or 400.0
    width = recipe.train.value_bytes
    if module != spec.name_of("llm"):
        shape, family = sample_shape(recipe), spec.family(module)
        rows = shape.patches + shape.images if family.modality == "image" else shape.audio_rows
        share = recipe.parallel.llm.dp * recipe.train.micro_batch // mp.dp
        return item_cost(family, spec.config(module), tflops=tflops, bandwidth_gbs=bandwidth,
                         tokens_per_gpu=share * max(rows, 1), tp=mp.tp, bytes_per_value=width)
    cfg = spec.llm
    return transformer_cost(layers=cfg.layers, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden, heads=cfg.heads,
                            kv_heads=cfg.kv_heads, vocab=cfg.vocab_size, head_dim=cfg.head_dim or None,
                            tflops=tflops, tp=mp.tp, bandwidth_gbs=bandwidth, bytes_per_value=width,
                            tokens_per_gpu=recipe.train.micro_batch * longest_seq(recipe.data))

"""Estimated peak memory of every rank of a recipe, with no processes and no weights.

Parameter counts come from the model's own pipeline layers built on the meta device, split over
stages as DeepSpeed splits them; activation bytes from ``estimate/activations.py``; and each
rank's total from the per-rank formula the planner also uses (``cost/memory_model.py``):
weights, gradients and optimizer states (sharded over DP under ZeRO-1), plus the activations of
the microbatches 1F1B keeps in flight at that stage along the whole chain of modules. ``--dry-run`` prints it; a real run checks it
before building anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from disttrain_ds.console import prefer_cpu_accelerator
from disttrain_ds.cost import memory_model as mm
from disttrain_ds.cost.memory_model import StageBytes, in_flight, with_buckets
from disttrain_ds.data.tokenizer import SMOLLM2_VOCAB, ByteTokenizer, load_tokenizer, special_tokens
from disttrain_ds.estimate.activations import LayerBytes, module_layers
from disttrain_ds.families import clear_build_caches
from disttrain_ds.mllm.recipe_spec import meta_spec
from disttrain_ds.models.configs import trains
from disttrain_ds.models.vae import vae_memory_bytes
from disttrain_ds.recipe.deepspeed import load_ds_config
from disttrain_ds.recipe.graph import as_written, encoder_of, graph_of, sliced_tp_chunks, topology_of
from disttrain_ds.recipe.schema import resolve_path
from disttrain_ds.reorder.post_balance import share_cap
from disttrain_ds.samples import SpecialTokens

GIB = 2**30
CPU_PROCESS_GIB = 0.5
"""Resident memory of one CPU rank before any model is built (Python, torch, DeepSpeed,
transformers, diffusers); measured about 0.45 GiB. Taken off each rank's share of host RAM."""


@dataclass(frozen=True)
class StageMemory:
    """Estimated peak bytes on each rank that holds one pipeline stage of one module."""

    module: str
    """encoder | llm | generator."""
    stage: int
    """Stage index inside the module."""
    ranks: range
    """Global ranks holding this stage (its DP and TP replicas hold the same)."""
    layers: range
    """Pipeline layers of the module on this stage."""
    params: int
    """Parameters of those layers (before tensor-parallel sharding)."""
    weights: float
    """Weight bytes per rank."""
    grads: float
    """Gradient bytes per rank (gradient accumulation buffers included)."""
    optimizer: float
    """Optimizer bytes per rank (fp32 master weights and moments; sharded over DP under ZeRO-1)."""
    activations: float
    """Bytes kept for backward by the microbatches in flight."""
    in_flight: int
    """Microbatches 1F1B keeps in flight here."""
    samples: int
    """Samples per microbatch on one replica."""
    extra: float = 0.0
    """Bytes held beside the stage (``extra_bytes``: a frozen model run outside the pipeline)."""
    bucket: float = 0.0
    """Bytes of one ZeRO gradient bucket (``reduce_bucket_bytes``): one beside the activations
    during backward, two at the gradient reduce."""

    @property
    def total(self) -> float:
        return float(self.weights + self.grads + self.optimizer + with_buckets(self.activations, self.bucket)
                     + self.extra)

    def who(self) -> str:
        """How errors name the stage: its first rank, module and stage."""
        more = f", like ranks {self.ranks.start + 1}-{self.ranks.stop - 1}" if len(self.ranks) > 1 else ""
        return f"rank {self.ranks.start} ({self.module} stage {self.stage}{more})"


def _zero_config(recipe, module: str) -> dict:
    """The ``zero_optimization`` section of ``module``'s DeepSpeed config ({} in the reference layout)."""
    if recipe.layout == "reference":
        return {}

    path = recipe.parallel.modules[module].ds_config or recipe.deepspeed_config
    return load_ds_config(resolve_path(path, recipe.source_file)).get("zero_optimization", {})


def zero_stage(recipe, module: str) -> int:
    """The ZeRO stage of ``module``'s DeepSpeed config (0 in the reference layout)."""
    return int(_zero_config(recipe, module).get("stage", 0))


REDUCE_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""


def reduce_bucket_bytes(recipe, module: str) -> float:
    """Bytes of one gradient bucket of ``module``'s ZeRO optimizer: with pipelines and contiguous
    gradients (DeepSpeed's default) ZeRO-1 allocates ``reduce_bucket_size`` fp32 elements at the
    first backward and as many again at the gradient reduce, whatever the model's size
    (``deepspeed/runtime/zero/stage_1_and_2.py``; measured: 2 x 191 MiB on every rank with
    ``ds_configs/zero1.json``). 0 without ZeRO or for a module that trains nothing."""
    zero = _zero_config(recipe, module)
    if int(zero.get("stage", 0)) < 1 or not zero.get("contiguous_gradients", True) \
            or not trains(recipe.model.modules[module]):
        return 0.0
    return 4.0 * float(zero.get("reduce_bucket_size", REDUCE_BUCKET_SIZE))


def state_bytes(recipe, module: str) -> tuple[float, float, float, bool]:
    """(weight, gradient, optimizer) bytes per parameter, and whether optimizer bytes shard over DP."""
    w = recipe.train.value_bytes
    if not trains(recipe.model.modules[module]):  # a trained projector counts as the module training
        return w, 0, 0, False
    moments = 2 if recipe.optim.name == "adamw" else 0  # torch SGD without momentum keeps none
    if recipe.layout == "reference":  # torch optimizer on the parameters themselves
        return w, w, moments * w, False
    if zero_stage(recipe, module) >= 1:  # fp32 master partition, its moments and its fp32 gradient
        return w, w, 4 + 4 * moments + 4, True
    if w == 2:  # DeepSpeed's bf16 optimizer: fp32 gradient accumulation, fp32 master partition
        return w, w + 4, 4 + 4 * moments, True
    return w, w, 4 * moments, False


def vocab_size(recipe) -> int:
    """The LLM vocabulary the runtime will build (``model.llm.vocab_size``, or the tokenizer's)."""
    if recipe.model.llm.vocab_size:
        return recipe.model.llm.vocab_size
    audio, gens = encoder_of(recipe, "audio") is not None, len(graph_of(recipe).generators)
    # The shipped tokenizers' sizes are known without reading them; neither brings special ids of its own.
    known = {"byte": ByteTokenizer.vocab_size, "smollm2": SMOLLM2_VOCAB}.get(recipe.data.tokenizer)
    if known is not None:
        return SpecialTokens.after(known, audio=audio, generators=gens).vocab_size
    tok = load_tokenizer(recipe.data.tokenizer, recipe.data.cache_dir)
    return special_tokens(tok, audio=audio, generators=gens).vocab_size


def meta_layers(recipe, module: str, vocab: int) -> list[tuple]:
    """(``LayerDef``, layer built on the meta device: no memory) of each pipeline layer of ``module``."""
    import torch

    try:
        with torch.device("meta"):
            return [(d, d.build()) for d in meta_spec(recipe, vocab).layers(module)]
    finally:  # the builders cache one whole model; never leave a meta one behind
        clear_build_caches()


def _layer_table(recipe, module: str, vocab: int) -> tuple[tuple[int, ...], tuple[Shared, ...]]:
    key = (json.dumps(as_written(recipe)["model"], sort_keys=True, default=str), module, vocab)
    if key not in _LAYER_PARAMS:
        pairs = meta_layers(recipe, module, vocab)
        index = {d.name: i for i, (d, _) in enumerate(pairs)}
        shared = tuple((i, index[lead.split("/", 1)[0]], layer.get_parameter(own).numel())
                       for i, (d, layer) in enumerate(pairs) for own, lead in d.ties)
        _LAYER_PARAMS[key] = (tuple(sum(p.numel() for p in layer.parameters()) for _, layer in pairs), shared)
    return _LAYER_PARAMS[key]


def layer_params(recipe, module: str, vocab: int) -> list[int]:
    """Parameters of each pipeline layer of ``module``, counted on the meta device once per model
    (the planner estimates one model under many layouts; layouts and data change no layer). A tied
    weight counts in both layers (two copies when they sit on two stages; ``shared_params``)."""
    return list(_layer_table(recipe, module, vocab)[0])


def shared_params(recipe, module: str, vocab: int) -> tuple[Shared, ...]:
    """The tied weights of ``module``: (follower layer, leader layer, parameters) each."""
    return _layer_table(recipe, module, vocab)[1]


Shared = tuple[int, int, int]
"""A tied weight: (index of the layer that follows, index of its leader, its parameters); one
parameter, counted once, where a stage holds both layers."""

_LAYER_PARAMS: dict[tuple[str, str, int], tuple[tuple[int, ...], tuple[Shared, ...]]] = {}
"""(model section as written, module, vocabulary) -> parameters per pipeline layer, tied weights."""


def stage_bounds(params: list[int], pp: int, method: str) -> list[int]:
    """Layer boundaries of ``pp`` stages, as DeepSpeed's PipelineModule computes them."""
    prefer_cpu_accelerator()  # importing DeepSpeed without a GPU would otherwise warn
    from deepspeed.runtime import utils as ds_utils

    if method == "parameters":
        return ds_utils.partition_balanced(weights=params, num_parts=pp)
    return ds_utils.partition_uniform(num_items=len(params), num_parts=pp)


def extra_bytes(recipe, module: str) -> float:
    """Bytes ``module``'s first stage holds beside its pipeline layers: a frozen model it runs
    outside its pipeline (a generator's VAE with ``vae.placement: generator``). The planner adds the
    same figure to the module's most loaded stage in every layout (``planner/recipe_memory.py``),
    an upper bound when that stage is not the first."""
    return _vae_bytes(recipe, module)


def _per_gpu(params: float, kept: float, per_param: tuple, dp: int, tp: int, samples: int, k: int,
             workspace: float = 0.0) -> list[float]:
    """(weights, grads, optimizer, activations) bytes of one rank by the shared per-rank formula
    (``planner.memory_model``): ``kept`` and ``workspace`` are per-sample bytes on one TP rank."""
    w, g, o, sharded = per_param
    return [*mm.state_bytes(params, tp, w, g, o, dp if sharded else 1),
            mm.activation_bytes(kept, workspace, samples, k)]


def _stage_activations(lb: LayerBytes, lo: int, hi: int, every: int = 0, tp: int = 1,
                       sp: int = 1, sliced: bool = False) -> tuple[float, float]:
    """Per-sample bytes on one TP rank of a stage holding layers ``lo:hi`` kept for each
    microbatch in flight (what its layers save, the TP-sharded part over ``tp``; the input it
    received beside the copy its first layer reads; its output), and the backward workspace of one
    microbatch (the gradients of one layer's saved tensors: about what the largest layer saves).

    With activation checkpointing in blocks of ``every`` layers (counted from the stage's first
    layer, as DeepSpeed's PipelineModule forms them), a microbatch in flight keeps only each
    block's input and the stage's output; backward recomputes one block at a time, so the
    workspace also holds what the largest block saves. Layer inputs and outputs are whole on
    every TP rank. With sequence parallelism (``sp``) every rank keeps 1/SP of each sequence: of
    what layers save and pass on, all but the module's own inputs (token ids and encoder rows,
    received whole by every SP rank). ``sliced``: tensor parallelism on sequence slices, whose
    layers keep and pass on slices where ``LayerBytes.sliced`` / ``sliced_outputs`` say."""
    saved = [b / sp for b in lb.on_rank(tp, sliced)]
    outputs = [b / sp for b in lb.outputs_on_rank(tp, sliced)]
    received = lb.inputs if lo == 0 else outputs[lo - 1]
    out = outputs[hi - 1] if hi > lo else 0.0
    grads = max(saved[lo:hi], default=0.0)
    if every <= 0:
        return sum(saved[lo:hi]) + received + out, grads
    starts = range(lo, hi, every)
    kept = received + sum(outputs[s - 1] for s in starts if s > lo) + out
    block = max((sum(saved[s:min(s + every, hi)]) for s in starts), default=0.0)
    return kept, block + grads


def stage_params(params: list[int], lo: int, hi: int, shared: tuple[Shared, ...] = ()) -> int:
    """Parameters a stage holding layers ``lo:hi`` keeps: a tied weight whose two layers are both
    here is one parameter."""
    return sum(params[lo:hi]) - sum(n for f, lead, n in shared if lo <= f < hi and lo <= lead < hi)


def module_stages(params: list[int], lb: LayerBytes, bounds: list[int], tp: int, every: int,
                  backward: bool, shared: tuple[Shared, ...] = (), sp: int = 1,
                  sliced: bool = False) -> list[StageBytes]:
    """Each stage of a module split at ``bounds`` (``stage_bounds``) at TP degree ``tp`` (and SP ``sp``;
    ``sliced``: TP on sequence slices): its parameters (``stage_params``) and the per-sample bytes
    one microbatch keeps there and one backward needs (``_stage_activations``; none for a module
    that runs no backward). What ``estimate`` prices every rank by, and the planner every layout by."""
    rows = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        kept, work = _stage_activations(lb, lo, hi, every, tp, sp, sliced) if backward else (0.0, 0.0)
        rows.append(StageBytes(float(stage_params(params, lo, hi, shared)), kept, work))
    return rows


def backward_modules(recipe) -> dict[str, bool]:
    """A module runs backward if it or anything upstream of it trains."""
    graph = graph_of(recipe)
    return graph.runs_backward({n: trains(recipe.model.modules[n]) for n in graph.names})


def replica_samples(recipe, grid, slot: int) -> int:
    """Most samples one replica of ``grid`` holds per microbatch: its even share, or with
    ``parallel.post_balance`` (not the LLM's, which keeps its blocks) up to ``share_cap`` of them."""
    if recipe.parallel.post_balance and grid.name != graph_of(recipe).llm and grid.dp > 1:
        return share_cap(slot, grid.dp, recipe.parallel.post_balance_share)
    return slot // grid.dp


def estimate(recipe, cuda: bool | None = None) -> list[StageMemory]:
    """Every stage of every module, with its estimated per-rank peak (reference: one row per
    module, all on rank 0). ``cuda``: whether the job runs on CUDA, which decides where
    ``tp_overlap: auto`` puts the LLM on sequence slices (default: whether this machine has CUDA,
    as the job started here would)."""
    if cuda is None:
        import torch  # deferred: heavy

        cuda = torch.cuda.is_available()
    vocab = vocab_size(recipe)
    backward = backward_modules(recipe)
    micro = recipe.train.micro_batch
    gas = recipe.train.global_batch // (recipe.parallel.llm.dp * micro)  # microbatches per step
    rows = []
    if recipe.layout == "reference":
        for name in graph_of(recipe).names:
            params, lb = layer_params(recipe, name, vocab), module_layers(recipe, name, vocab)
            held = stage_params(params, 0, len(params), shared_params(recipe, name, vocab))
            act, work = _stage_activations(lb, 0, len(lb.saved)) if backward[name] else (0.0, 0.0)
            parts = _per_gpu(held, act, state_bytes(recipe, name), 1, 1, micro, 1, work)
            rows.append(StageMemory(name, 0, range(1), range(len(params)), held, *parts, 1, micro,
                                    extra_bytes(recipe, name)))
        return rows

    topo = topology_of(recipe)
    slot = recipe.parallel.llm.dp * micro
    for grid in topo.modules:
        params, lb = layer_params(recipe, grid.name, vocab), module_layers(recipe, grid.name, vocab)
        par = recipe.parallel.modules[grid.name]
        bounds = stage_bounds(params, grid.pp, par.partition)
        samples, extra, bucket = replica_samples(recipe, grid, slot), extra_bytes(recipe, grid.name), reduce_bucket_bytes(recipe, grid.name)
        stages = module_stages(params, lb, bounds, grid.tp, par.activation_checkpointing, backward[grid.name],
                               shared_params(recipe, grid.name, vocab), grid.sp,
                               sliced_tp_chunks(recipe, grid.name, grid.tp, cuda) > 0)
        for s, st in enumerate(stages):
            k = int(in_flight(topo.total_stages - topo.stage_offset(grid.name) - s, gas))
            # ZeRO shards optimizer state over DeepSpeed's whole data axis (DP x SP).
            parts = _per_gpu(st.params, st.kept, state_bytes(recipe, grid.name), grid.data_size, grid.tp, samples, k,
                             st.workspace)
            last = grid.rank(stage=s, dp=grid.dp - 1, tp=grid.tp - 1, sp=grid.sp - 1)
            ranks = range(grid.rank(stage=s, dp=0), last + 1)
            rows.append(StageMemory(grid.name, s, ranks, range(bounds[s], bounds[s + 1]), int(st.params), *parts,
                                    k, samples, extra if s == 0 else 0.0, bucket))
    return rows


def _vae_bytes(recipe, module: str) -> float:
    """The VAE's bytes on ``module``'s first stage: only a generator that encodes its own targets
    (on a GPU: in the compute dtype, ``vae.batch_on("cuda")`` images at a time)."""
    cfg = recipe.model.modules[module]
    vae = getattr(cfg, "vae", None)
    if vae is None or not vae.enabled or vae.placement != "generator":
        return 0.0

    elem = recipe.train.value_bytes
    return sum(vae_memory_bytes(vae, cfg.resolution * vae.downsample, vae.batch_on("cuda"), elem))


def per_rank_totals(rows: list[StageMemory]) -> dict[int, float]:
    """Estimated peak bytes of each rank (the reference layout's modules share rank 0)."""
    totals: dict[int, float] = {}
    for row in rows:
        for r in row.ranks:
            totals[r] = totals.get(r, 0.0) + row.total
    return totals


def _size(n: float, short: bool = False) -> str:
    """Bytes in GiB (MiB below 0.1 GiB); ``short``: a table cell."""
    value, unit = (n / GIB, "GiB") if n >= GIB / 10 else (n / 2**20, "MiB")
    return f"{value:.2f}{unit[0]}" if short else f"{value:.1f} {unit}"

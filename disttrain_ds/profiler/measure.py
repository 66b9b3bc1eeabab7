"""Timing a recipe's modules: forward+backward per sample, fed real upstream outputs.

Any module graph the runtime trains: each encoder on what it reads of the samples (images, or
log-mel audio clips), the LLM on every encoder's embeddings (none in a generation-only graph),
each generator on the LLM's states.

Used by ``python -m disttrain_ds.cli.profile`` (TP=1, one process) and by ``profiler/tp.py`` (each
tensor-parallel rank with its shards).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.configs import trains
from disttrain_ds.models.layers import Sequential
from disttrain_ds.models.objectives import diffusion_loss, lm_loss_sum
from disttrain_ds.models.vae import generator_vae
from disttrain_ds.recipe.graph import graph_of, module_config, module_family
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.runtime.emulate import patch_size, sample_flops

if TYPE_CHECKING:  # the model modules load transformers and diffusers; see profile_recipe
    from disttrain_ds.mllm.model import MicroBatch, MLLMSpec
    from disttrain_ds.samples import PackedSample

Grads = tuple[list[torch.Tensor], list[torch.Tensor | None]]


@dataclass
class Options:
    """How to measure."""

    samples: int = 8
    """Samples drawn from the recipe's data source; each is timed once per module."""
    warmup: int = 2
    """Untimed forward+backward passes per module before timing."""
    device: torch.device = torch.device("cpu")
    """Where the modules run."""
    dtype: torch.dtype = torch.float32
    """Compute dtype (the recipe's ``train.dtype``)."""
    build: Callable[[str, Any], torch.nn.Module] | None = None
    """Builds one layer of a module from (module name, its ``LayerDef``) (default: whole;
    tensor-parallel shards in profiler/tp.py)."""
    sync: Callable[[], None] | None = None
    """Called before each timed pass (tensor-parallel ranks start each pass together)."""


@dataclass
class Pass:
    """One module's work on one sample."""

    inputs: tuple
    """The module's input tuple on the device; float inputs needing a gradient already require it."""
    head: Callable[[Any], Grads]
    """Module output -> (tensors to differentiate, their incoming gradients). Runs inside the timed
    region, so a loss computed here (the LM or diffusion loss) is timed with its module."""
    carry: Callable[[Any], Any]
    """Module output -> what the next module takes from it."""
    flops: float
    """Training FLOPs of this pass (cost/flops.py conventions)."""


@dataclass
class ModuleResult:
    """What was measured for one module."""

    name: str
    """The module's name in the recipe's graph."""
    mode: str
    """train | frozen_passthrough (forward + input gradient) | frozen (forward only)."""
    layers: int
    """Blocks of equal cost a pipeline degree must divide (ViT blocks, decoder layers, U-Net blocks)."""
    params: int
    """Parameter count."""
    times_ms: list[float]
    """Forward+backward time of each sample."""
    flops: list[float]
    """Training FLOPs of each sample."""
    activation_bytes: int
    """Largest bytes saved for backward over the samples (saved-tensor hooks; 0 when forward only)."""
    memory_bytes: float
    """CUDA: peak allocated while timing. CPU: weights + gradients + activation_bytes."""
    role: str
    """encoder | llm | generator."""
    work: list[float] = field(default_factory=list)
    """Forward FLOPs of each sample by the runtime's cost model (``runtime.setup.cost_model``:
    what the module computes, padding included, as reordering and emulation price a sample);
    ``flops`` counts useful FLOPs only (documents, for MFU) and can vary where the work does not."""
    rows: list[int] = field(default_factory=list)
    """Encoders: the rows (LLM tokens) each sample's items make, what sequence parallelism's
    all-to-alls carry; empty for other modules."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def p90_ms(self) -> float:
        return float(torch.tensor(self.times_ms, dtype=torch.float64).quantile(0.9))  # linear, as numpy

    @property
    def tflops(self) -> float:  # median over the samples
        return statistics.median(f / t / 1e9 for f, t in zip(self.flops, self.times_ms))


def modes(recipe: Recipe) -> dict[str, tuple[str, bool]]:
    """Per module: (mode, whether its float input needs a gradient for a trained module upstream).
    Upstream of an encoder is nothing; of the LLM, the encoders; of a generator, the LLM and the
    encoders (their gradients pass through the LLM)."""
    graph = graph_of(recipe)
    trained = {n: trains(module_config(recipe, n)) for n in graph.names}
    out = {}
    for name in graph.names:
        role = graph.role(name)
        above = () if role == "encoder" else graph.encoders + ((graph.llm,) if role == "generator" else ())
        upstream = any(trained[n] for n in above)
        out[name] = ("train" if trained[name] else ("frozen_passthrough" if upstream else "frozen"), upstream)
    return out


def block_count(recipe: Recipe, name: str) -> int:
    """The profile's ``layers``: blocks of equal cost (a PP degree dividing it fits the recipe too)."""
    cfg = module_config(recipe, name)
    if graph_of(recipe).role(name) == "generator":
        return len(cfg.down_block_types) + 1 + len(cfg.up_block_types)
    return module_family(recipe, name).run_layers(cfg)


def time_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Time of ``fn`` in ms: CUDA events around it on a GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # nothing queued earlier may land in the window
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def saved_bytes(model: torch.nn.Module, p: Pass) -> int:
    """Bytes autograd keeps for backward in one forward pass: parameters excluded, each storage
    counted once (many saved tensors are views of one buffer)."""
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        graph = p.head(model(p.inputs))  # noqa: F841  alive until summed: no address is reused meanwhile
    return sum(seen.values())


def measure_module(recipe: Recipe, spec: MLLMSpec, name: str, passes: list[Pass], opts: Options
                   ) -> tuple[ModuleResult, list[Any]]:
    """Time ``passes`` on a freshly built module; returns the result and each pass's carry."""
    mode, _ = modes(recipe)[name]
    try:
        build = opts.build or (lambda _, d: d.build())
        model = Sequential([build(name, d) for d in spec.layers(name)]).to(opts.device, opts.dtype)
    except ValueError as exc:  # sizes the recipe check cannot see (e.g. heads not dividing width)
        raise ConfigError(f"{recipe.source_file}: cannot build the {name}: {exc}") from None
    model.requires_grad_(mode == "train")
    backward = mode != "frozen"
    with torch.no_grad():
        carries = [p.carry(model(p.inputs)) for p in passes]

    def step(p: Pass) -> None:
        with torch.set_grad_enabled(backward):
            pairs = [(t, g) for t, g in zip(*p.head(model(p.inputs))) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def clear(p: Pass) -> None:  # fresh gradients for every pass, outside the timed region
        model.zero_grad(set_to_none=True)
        for t in p.inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None

    for i in range(opts.warmup):
        clear(passes[i % len(passes)])
        step(passes[i % len(passes)])
    if opts.device.type == "cuda":
        torch.cuda.synchronize(opts.device)
        torch.cuda.reset_peak_memory_stats(opts.device)
    times = []
    for p in passes:
        clear(p)
        if opts.sync is not None:
            opts.sync()
        times.append(time_ms(lambda: step(p), opts.device))
    peak = float(torch.cuda.max_memory_allocated(opts.device)) if opts.device.type == "cuda" else 0.0
    acts = max(saved_bytes(model, p) for p in passes) if backward else 0
    params = list(model.parameters())
    # CPU estimate: weights, their gradients when trained, activations held for backward.
    memory = peak or float(sum(t.numel() * t.element_size() for t in params) * (1 + (mode == "train")) + acts)
    return ModuleResult(name, mode, block_count(recipe, name), sum(t.numel() for t in params), times,
                        [p.flops for p in passes], acts, memory, graph_of(recipe).role(name)), carries


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    return type(mb)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.__dict__.items()})


def profile_recipe(recipe: Recipe, opts: Options, whole: frozenset[str] = frozenset()) -> list[ModuleResult]:
    """Measure every module of ``recipe``'s graph on ``opts.samples`` of its samples, in data-flow
    order (encoders, the LLM, generators), each fed its upstream module's real output.

    Modules in ``whole`` run with whole layers and no ``opts.sync`` (they only feed the next module).
    """
    graph = graph_of(recipe)
    # Model code is imported only once the recipe and arguments are known to be good, so errors come back at once.
    # deferred: loads safetensors
    from disttrain_ds.metrics.step_flops import StepFlopsCounter
    from disttrain_ds.mllm.model import BatchNorms, collate, gen_states, generator_states, llm_inputs
    from disttrain_ds.runtime.setup import build_data_and_spec

    torch.manual_seed(recipe.seed)
    # A "global batch" of exactly the samples to time: a real one may hold thousands of sequences.
    sized = replace(recipe, train=replace(recipe.train, global_batch=opts.samples))
    try:
        source, spec = build_data_and_spec(sized)
    except ValueError as exc:
        raise ConfigError(f"{recipe.source_file}: {exc}") from None
    try:
        samples = source.global_batch(0)
    finally:
        source.close()  # stops producer processes, if any
    vae = generator_vae(spec, opts.device, opts.dtype)  # vae.placement generator: pixels come (the VAE is not timed)
    mbs = [_to(collate([s], BatchNorms.of([s], 1), spec, dtype=opts.dtype, vae=vae), opts.device) for s in samples]
    lm, mode, dev, dt = spec.llm, modes(recipe), opts.device, opts.dtype
    gens = graph.generators
    # Useful FLOPs as the training MFU counts them (documents only, padding and stand-ins left out).
    count = StepFlopsCounter(spec)

    def encoder_pass(name: str, mb: MicroBatch, sample: PackedSample) -> Pass:
        fam = spec.family(name)
        rows = spec.item_rows(name, sample)
        grad = torch.randn(rows, lm.hidden_size, device=dev, dtype=dt)  # what the LLM sends back
        return Pass(mb.encoder_inputs(fam.modality), lambda out: ([out], [grad]), lambda out: out,
                    count.module(name, [sample]))

    def llm_pass(mb: MicroBatch, sample: PackedSample, embeds: list[torch.Tensor]) -> Pass:
        name = graph.llm
        if not embeds:  # no encoder: no image embeddings (as the reference model feeds it)
            embeds = [torch.zeros(0, lm.hidden_size, device=dev, dtype=dt)]
        embeds = [x.detach().clone().requires_grad_(mode[name][1]) for x in embeds]
        # What each generator sends back: gradients for the states at its own queries.
        grads = {n: torch.randn(sum(mb.sample_rows[spec.gen_rows_key(n)]), spec.config(n).query_tokens, lm.hidden_size,
                                device=dev, dtype=dt) for n in gens}

        def head(out: Any) -> Grads:
            logits, hidden = out
            tensors, back = [lm_loss_sum(logits, mb.labels, mb.lm_scale)], [None]
            for n, states in zip(gens, gen_states(hidden, mb, spec)):
                if states.shape[0]:
                    tensors.append(states)
                    back.append(grads[n])
            return tensors, back

        def carry(out: Any) -> Any:
            return {n: generator_states(x, mb, n) for n, x in zip(gens, gen_states(out[1], mb, spec))}

        return Pass(llm_inputs(mb, embeds), head, carry, count.module(name, [sample]))

    def generator_passes(name: str, states: list[dict[str, torch.Tensor]]) -> list[Pass]:
        def one(mb: MicroBatch, sample: PackedSample, x: torch.Tensor) -> Pass:
            x, g = x.detach().clone().requires_grad_(mode[name][1]), mb.gens[name]
            head = lambda out: ([diffusion_loss(out, g.noise, g.weights)], [None])  # noqa: E731
            # No target: one zero stand-in runs, with no useful FLOPs.
            return Pass((x, g.noisy, g.timesteps), head, lambda out: None, count.module(name, [sample]))

        return [one(mb, s, x[name]) for mb, s, x in zip(mbs, samples, states)]

    def o(name: str) -> Options:
        return replace(opts, build=None, sync=None) if name in whole else opts

    results, embeds = [], [[] for _ in mbs]  # per microbatch, each encoder's rows in graph order
    for name in graph.encoders:
        res, rows = measure_module(recipe, spec, name, [encoder_pass(name, mb, s) for mb, s in zip(mbs, samples)], o(name))
        res.rows = [int(r.shape[0]) for r in rows]
        results.append(res)
        embeds = [x + [r] for x, r in zip(embeds, rows)]
    llm_passes = [llm_pass(mb, s, x) for mb, s, x in zip(mbs, samples, embeds)]
    res, states = measure_module(recipe, spec, graph.llm, llm_passes, o(graph.llm))
    results.append(res)
    for name in gens:
        results.append(measure_module(recipe, spec, name, generator_passes(name, states), o(name))[0])
    # deferred: loads safetensors
    from disttrain_ds.runtime.setup import cost_model

    model = cost_model(recipe)
    for r in results:
        r.work = [sample_flops(model, r.name, s, patch_size(recipe, r.name), spec.special) for s in samples]
    return results

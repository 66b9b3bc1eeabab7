"""Measure a recipe's three modules and write a planner profile (see docs/profiler.md).

    python -m disttrain_ds.profile --recipe R.yaml [key=value ...] [--samples 8] [--warmup 2]
        [--gpus N] [--global-batch BS] [--gpus-per-node 8] [--out profile.json] [--force]

Each module is built from its real layers and runs forward+backward on samples drawn from the
recipe's data source, fed the real output of the module before it. The median time per sample is
``cost_ms`` at TP=1; TP=2/4/8 are not measured (the profiler is one process) but interpolated as
C(t) = C(1) / (t * eff^log2 t), which the profile's ``description`` says. Errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from disttrain_ds.config import Recipe, load_recipe
from disttrain_ds.cli import OneLineParser
from disttrain_ds.configtools import ConfigError
from disttrain_ds.metrics.flops import llm_flops_packed, projector_flops_per_token, unet_flops, vit_flops
from disttrain_ds.metrics.peak import resolve_peak
from disttrain_ds.models.layers import Sequential
from disttrain_ds.planner.profile import GIB, MODULES, TP_DEGREES, ModuleProfile, Profile, save_profile

if TYPE_CHECKING:  # the model modules load transformers and diffusers; see profile_recipe
    from disttrain_ds.data.types import PackedSample
    from disttrain_ds.models.mllm import MicroBatch, MLLMSpec

PROG = "python -m disttrain_ds.profile"
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
    """Training FLOPs of this pass (metrics/flops.py conventions)."""


@dataclass
class ModuleResult:
    """What was measured for one module."""

    name: str
    """encoder | llm | generator."""
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
    """Per module: (mode, whether its float input needs a gradient for a trained module upstream)."""
    out, upstream = {}, False
    for name in MODULES:
        frozen = getattr(recipe.model, name).frozen
        out[name] = (("frozen_passthrough" if upstream else "frozen") if frozen else "train", upstream)
        upstream = upstream or not frozen
    return out


def block_count(recipe: Recipe, name: str) -> int:
    """The profile's ``layers``: blocks of equal cost (a PP degree dividing it fits the recipe too)."""
    if name == "generator":
        g = recipe.model.generator
        return len(g.down_block_types) + 1 + len(g.up_block_types)
    return getattr(recipe.model, name).layers


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
        model = Sequential([d.build() for d in spec.layers(name)]).to(opts.device, opts.dtype)
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
        times.append(time_ms(lambda: step(p), opts.device))
    peak = float(torch.cuda.max_memory_allocated(opts.device)) if opts.device.type == "cuda" else 0.0
    acts = max(saved_bytes(model, p) for p in passes) if backward else 0
    params = list(model.parameters())
    # CPU estimate: weights, their gradients when trained, activations held for backward.
    memory = peak or float(sum(t.numel() * t.element_size() for t in params) * (1 + (mode == "train")) + acts)
    return ModuleResult(name, mode, block_count(recipe, name), sum(t.numel() for t in params), times,
                        [p.flops for p in passes], acts, memory), carries


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    return type(mb)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.__dict__.items()})


def profile_recipe(recipe: Recipe, opts: Options) -> list[ModuleResult]:
    """Measure the encoder, LLM and generator of ``recipe`` on ``opts.samples`` of its samples."""
    # Model code pulls in transformers and diffusers (seconds): imported only once the recipe and
    # arguments are known to be good, so errors come back at once.
    from disttrain_ds.models.llama import gen_condition
    from disttrain_ds.models.mllm import BatchNorms, collate, generator_states, lm_loss_sum
    from disttrain_ds.models.unet import build_unet, diffusion_loss
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
    mbs = [_to(collate([s], BatchNorms.of([s], 1), spec, dtype=opts.dtype), opts.device) for s in samples]
    e, lm, g, mode, dev, dt = spec.encoder, spec.llm, spec.generator, modes(recipe), opts.device, opts.dtype

    def encoder_pass(mb: MicroBatch) -> Pass:
        patches = [(h // e.patch_size) * (w // e.patch_size) for h, w in mb.image_hw.tolist()]
        flops = 0.0
        if patches:
            m = mode["encoder"][0]
            flops = vit_flops(layers=e.layers, hidden=e.hidden_size, ffn_hidden=e.ffn_hidden,
                              patches_per_image=patches, patch_size=e.patch_size, mode=m)
            flops += sum(patches) * projector_flops_per_token(
                in_dim=e.hidden_size, hidden_dim=lm.hidden_size, out_dim=lm.hidden_size, mode=m)
        grad = torch.randn(sum(patches), lm.hidden_size, device=dev, dtype=dt)  # what the LLM sends back
        return Pass((mb.pixels, mb.image_hw), lambda out: ([out], [grad]), lambda out: out, flops)

    def llm_pass(mb: MicroBatch, sample: PackedSample, embeds: torch.Tensor) -> Pass:
        embeds = embeds.detach().clone().requires_grad_(mode["llm"][1])
        n_gen = mb.sample_rows["gen_states"][0]
        grad = torch.randn(n_gen, g.query_tokens, lm.hidden_size, device=dev, dtype=dt)
        # Useful FLOPs: documents only, padding left out (as the training MFU counts them).
        docs = [n for n in sample.doc_lens if n > 0] or [int((mb.input_ids != spec.special.pad).sum()) or 1]
        flops = llm_flops_packed(layers=lm.layers, hidden=lm.hidden_size, ffn_hidden=lm.ffn_hidden, heads=lm.heads,
                                 kv_heads=lm.kv_heads, vocab=lm.vocab_size, doc_lens=docs, mode=mode["llm"][0])

        def head(out: Any) -> Grads:
            logits, hidden = out
            tensors, grads = [lm_loss_sum(logits, mb.labels, mb.lm_scale)], [None]
            if n_gen:  # the generator sends gradients for the generation-query states
                tensors.append(gen_condition(hidden, mb.gen_mask, g.query_tokens))
                grads.append(grad)
            return tensors, grads

        carry = lambda out: generator_states(gen_condition(out[1], mb.gen_mask, g.query_tokens), mb)  # noqa: E731
        return Pass((mb.input_ids, embeds), head, carry, flops)

    gen_mode = mode["generator"][0]
    with torch.device("meta"):  # only the U-Net's config is needed: allocate nothing
        unet_config = {k: v for k, v in build_unet(g).config.items() if not k.startswith("_")}
    per_image = unet_flops(unet_config, batch=1, resolution=g.resolution, cond_tokens=g.query_tokens,
                           mode=gen_mode) + g.query_tokens * projector_flops_per_token(
        in_dim=lm.hidden_size, hidden_dim=g.cross_attention_dim, out_dim=g.cross_attention_dim, mode=gen_mode)

    def generator_pass(mb: MicroBatch, states: torch.Tensor) -> Pass:
        states = states.detach().clone().requires_grad_(mode["generator"][1])
        n_gen = mb.sample_rows["gen_states"][0]  # none: one zero stand-in runs, with no useful FLOPs
        head = lambda out: ([diffusion_loss(out, mb.noise, mb.gen_weights)], [None])  # noqa: E731
        return Pass((states, mb.noisy, mb.timesteps), head, lambda out: None, n_gen * per_image)

    enc, embeds = measure_module(recipe, spec, "encoder", [encoder_pass(mb) for mb in mbs], opts)
    llm_passes = [llm_pass(mb, s, x) for mb, s, x in zip(mbs, samples, embeds)]
    llm, states = measure_module(recipe, spec, "llm", llm_passes, opts)
    gen, _ = measure_module(recipe, spec, "generator", [generator_pass(mb, x) for mb, x in zip(mbs, states)], opts)
    return [enc, llm, gen]


def tp_costs(c1: float, efficiency: float, gpus_per_node: int) -> dict[int, float]:
    """cost_ms per TP degree: measured C(1), and C(t) = C(1) / (t * eff^log2 t) for t > 1."""
    return {t: c1 / (t * efficiency ** math.log2(t)) for t in TP_DEGREES if t <= gpus_per_node}


def build_profile(recipe: Recipe, results: list[ModuleResult], args: argparse.Namespace, opts: Options,
                  device_name: str, peak: tuple[float, str]) -> Profile:
    """The planner profile of ``results``; provenance goes in ``description`` (the schema is closed)."""
    width = float(torch.empty(0, dtype=opts.dtype).element_size())
    # Adam's two fp32 moments (this SGD has no momentum), plus fp32 master weights under bf16.
    optim = (8.0 if recipe.optim.name == "adamw" else 0.0) + (4.0 if recipe.train.dtype == "bf16" else 0.0)
    modules = {r.name: ModuleProfile(
        layers=r.layers, cost_ms=tp_costs(r.median_ms, args.tp_efficiency, args.gpus_per_node),
        params=float(r.params), frozen=r.mode != "train", weight_bytes_per_param=width,
        grad_bytes_per_param=width, optimizer_bytes_per_param=optim,
        activation_bytes_per_sample=float(r.activation_bytes), flops_per_sample=statistics.median(r.flops))
        for r in results}
    p90 = ", ".join(f"{r.name} {r.p90_ms:.4g}" for r in results)
    interp = [t for t in TP_DEGREES if 1 < t <= args.gpus_per_node]
    text = (f"Profiled by {PROG} from {recipe.source_file}{''.join(' ' + o for o in args.overrides)} on "
            f"{device_name}, {recipe.train.dtype}, {opts.samples} samples after {opts.warmup} warm-up passes. "
            f"cost_ms: TP=1 measured (median; p90 ms: {p90})")
    if interp:
        text += (f"; TP={'/'.join(map(str, interp))} interpolated, not measured: "
                 f"C(t) = C(1) / (t * {args.tp_efficiency}^log2 t)")
    text += (". flops_per_sample: median; activation_bytes_per_sample: largest over the samples; "
             f"peak_tflops: {peak[1]}.")
    mem = args.gpu_memory_gb
    if mem is None and opts.device.type == "cuda":
        mem = torch.cuda.get_device_properties(opts.device).total_memory / GIB
    p = recipe.parallel
    gpus = args.gpus or sum(m.dp * m.tp * m.pp for m in (p.encoder, p.llm, p.generator))
    return Profile(gpus=gpus, global_batch=args.global_batch or recipe.train.global_batch, modules=modules,
                   microbatch=recipe.train.micro_batch, gpus_per_node=args.gpus_per_node,
                   gpu_memory_gb=mem, peak_tflops=peak[0], description=text)


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_report(results: list[ModuleResult], profile: Profile, cuda: bool, efficiency: float) -> str:
    """Human-readable per-module table and what its numbers mean."""
    lines = [f"{'module':<10} {'mode':<18} {'params':>7} {'median ms':>10} {'p90 ms':>9} "
             f"{'FLOPs/sample':>12} {'TFLOP/s':>8} {'mem MiB':>8}"]
    for r in results:
        lines.append(f"{r.name:<10} {r.mode:<18} {_si(r.params):>7} {r.median_ms:>10.2f} {r.p90_ms:>9.2f} "
                     f"{_si(statistics.median(r.flops)):>12} {r.tflops:>8.3g} {r.memory_bytes / 2**20:>8.1f}")
    lines.append("mem: " + ("peak allocated while timing (CUDA)" if cuda else
                            "estimate = weights + gradients + activations saved for backward"))
    if interp := "/".join(str(t) for t in profile.modules["llm"].cost_ms if t > 1):
        lines.append(f"cost_ms at TP={interp} interpolated (not measured): C(t) = C(1) / (t * "
                     f"{efficiency}^log2 t)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    ap = OneLineParser(prog=PROG, description="Measure each module of a recipe's model and write a "
                 "profile for python -m disttrain_ds.plan.")
    ap.add_argument("--recipe", required=True, type=Path, help="recipe YAML (see recipes/)")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. model.llm.layers=8")
    ap.add_argument("--samples", type=int, default=8, help="samples to time (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed passes per module first (default 2)")
    ap.add_argument("--gpus", type=int, help="GPUs the plan may use (default: the recipe's layout)")
    ap.add_argument("--global-batch", type=int, help="default: the recipe's train.global_batch")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="bounds TP (default 8)")
    ap.add_argument("--tp-efficiency", type=float, default=0.9,
                    help="assumed efficiency per TP doubling for the interpolated TP>1 costs (default 0.9)")
    ap.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (default: this GPU's; none on CPU)")
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU (default: table or CPU estimate)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", type=Path, default=Path("profile.json"), help="profile JSON to write")
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    return ap


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, or None."""
    for key, low in {"samples": 1, "warmup": 0, "gpus": 1, "global_batch": 1, "gpus_per_node": 1}.items():
        if getattr(args, key) is not None and getattr(args, key) < low:
            return f"--{key.replace('_', '-')} must be >= {low}, got {getattr(args, key)}"
    for key in ("gpu_memory_gb", "peak_tflops", "tp_efficiency"):
        if getattr(args, key) is not None and not getattr(args, key) > 0:  # NaN fails too
            return f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}"
    if args.tp_efficiency > 1:
        return f"--tp-efficiency must be <= 1, got {args.tp_efficiency}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available"
    if args.out.exists() and not args.force:
        return f"{args.out}: already exists (use --force to overwrite)"
    if not args.out.parent.is_dir():
        return f"{args.out.parent}: no such directory"
    return None


def peak_tflops(override: float | None, gpu_name: str | None) -> tuple[float, str]:
    """(peak TFLOP/s per device, its source): --peak-tflops, the GPU table, or a CPU estimate."""
    if override is not None:
        return override, "--peak-tflops"
    try:
        return resolve_peak(None, gpu_name)
    except ValueError as exc:  # a GPU missing from the table
        raise ConfigError(f"{exc.args[0].split(';')[0]}; pass --peak-tflops") from None


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_intermixed_args(argv)
    if (problem := check_args(args)) is not None:
        return _fail(problem)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else f"cpu (torch threads: {torch.get_num_threads()})"
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        dtype = torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32
        opts = Options(args.samples, args.warmup, device, dtype)
        peak = peak_tflops(args.peak_tflops, name if cuda else None)
        print(f"profiling {args.recipe} on {name}, {recipe.train.dtype}, {opts.samples} samples after "
              f"{opts.warmup} warm-up passes", file=sys.stderr)
        results = profile_recipe(recipe, opts)
        profile = build_profile(recipe, results, args, opts, name, peak)
    except (ConfigError, torch.OutOfMemoryError) as exc:
        return _fail(str(exc).splitlines()[0])
    if args.out.exists() and not args.force:  # appeared while measuring
        return _fail(f"{args.out}: already exists (use --force to overwrite)")
    save_profile(profile, args.out)
    print(format_report(results, profile, cuda, args.tp_efficiency))
    print(f"wrote {args.out}; plan with: python -m disttrain_ds.plan --profile {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure a recipe's modules and write a planner profile (see docs/profiler.md).

    disttrain-profile --recipe R.yaml [key=value ...] [--samples 8] [--warmup 2]
        [--gpus N] [--global-batch BS] [--gpus-per-node 8] [--measure-tp 2 4 8] [--out profile.json] [--force]

(``python -m disttrain_ds.cli.profile`` is the same command; ``--recipe`` also takes a shipped recipe's name.)

Each module of the recipe's graph (the three-module form, or ``model.modules`` with any names)
is built from its real layers and runs forward+backward on samples drawn from the recipe's data
source, fed the real output of its upstream module; the profile names the modules as the recipe
does, with their roles. The median time per sample is
``cost_ms`` at TP=1. ``--measure-tp 2 4 8`` also measures those degrees with that many processes
(``profiler/tp.py``); other degrees are interpolated as C(t) = C(1) / (t * eff^log2 t), and degrees a
module's sizes do not split are left out. The profile's ``description`` says which is which.
Errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from disttrain_ds.cli import OneLineParser, prog_name
from disttrain_ds.cost.peak import resolve_peak
from disttrain_ds.cost.profile import GIB, TP_DEGREES, ModuleProfile, Profile
from disttrain_ds.cost.profile_file import save_profile
from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate.activations import module_layers
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.profiler.measure import ModuleResult, Options, profile_recipe
from disttrain_ds.profiler.tp import cost_table, measure_tp
from disttrain_ds.recipe.graph import module_config, module_family
from disttrain_ds.recipe.schema import Recipe, load_recipe
from disttrain_ds.reorder.sp_groups import exchange_cost, module_a2a_bytes
from disttrain_ds.runtime.emulate import data_work

PROG = prog_name("disttrain-profile", "python -m disttrain_ds.cli.profile")


def sp_fields(recipe: Recipe, result: ModuleResult, per_node: int) -> dict:
    """A module's sequence-parallel fields, for SP 2, 4, 8 (up to a node): one sample's all-to-all
    ms, modelled from the model's sizes at ``parallel.sp_bandwidth_gbs`` (``reorder/sp_groups.py``)
    for the LLM's ``data.seq_len`` tokens or an encoder's median rows over the timed samples, and
    the heads SP splits; empty for a module whose family has no SP path or an encoder that read no
    items."""
    family, cfg = module_family(recipe, result.name), module_config(recipe, result.name)
    if family.sp_heads is None or (result.role != "llm" and not any(result.rows)):
        return {}
    tokens = recipe.data.seq_len if result.role == "llm" else statistics.median(result.rows)
    inside, _ = recipe.parallel.sp_bandwidth_gbs
    sizes = [s for s in (2, 4, 8) if s <= per_node]
    per_token = module_a2a_bytes(family, cfg, bytes_per_value=recipe.train.value_bytes)
    cost = exchange_cost(per_token, {s: inside for s in sizes} or {1: inside})
    return {"sp_overhead_ms": {s: cost.a2a_ms(tokens, s) for s in sizes}, "attention_heads": family.sp_heads(cfg)}


def checkpointing_fields(recipe: Recipe, module: str) -> dict[str, float]:
    """The planner's activation-checkpointing fields of ``module``: the recipe's block size and
    the largest per-sample layer output of the runtime's activation formulas (what a checkpointed
    block keeps; largest sample the recipe's data allows); empty when the module keeps all."""
    every = recipe.parallel.modules[module].activation_checkpointing
    if not every:
        return {}
    # deferred: loads safetensors
    from disttrain_ds.estimate.memory import vocab_size

    outputs = module_layers(recipe, module, vocab_size(recipe)).outputs
    return {"activation_checkpointing": every, "layer_output_bytes_per_sample": float(max(outputs))}


def build_profile(recipe: Recipe, results: list[ModuleResult], args: argparse.Namespace, opts: Options,
                  device_name: str, peak: tuple[float, str], tp_table: tuple[dict[str, dict[int, float]], str],
                  measured_tp: frozenset[int] = frozenset()) -> Profile:
    """The planner profile of ``results``; provenance goes in ``description`` (the schema is closed).

    ``tp_table``: ``profiler.tp.cost_table``'s cost_ms per module and TP degree, and its sentence;
    ``measured_tp``: the TP > 1 degrees timed with ``--measure-tp`` (the rest are interpolated).
    """
    width = float(torch.empty(0, dtype=opts.dtype).element_size())
    # Adam's two fp32 moments (this SGD has no momentum), plus fp32 master weights under bf16.
    optim = (8.0 if recipe.optim.name == "adamw" else 0.0) + (4.0 if recipe.train.dtype == "bf16" else 0.0)
    costs, tp_text = tp_table
    data, units = data_work(recipe, args.draw_from) if args.draw_from else (None, {})
    draws = sample_draws(results, costs, None if data is None else {n: list(v) for n, v in data.items()})
    split = unit_draws(draws, units) if draws is not None else {}
    modules = {r.name: ModuleProfile(
        layers=r.layers, cost_ms=costs[r.name],
        params=float(r.params), frozen=r.mode != "train", weight_bytes_per_param=width,
        grad_bytes_per_param=width, optimizer_bytes_per_param=optim,
        activation_bytes_per_sample=float(r.activation_bytes), flops_per_sample=statistics.median(r.flops),
        sample_cost_ms=None if draws is None else draws[r.name], unit_cost_ms=split.get(r.name),
        cost_source={t: "measured" if t == 1 or t in measured_tp else "interpolated" for t in costs[r.name]},
        **checkpointing_fields(recipe, r.name), **sp_fields(recipe, r, args.gpus_per_node))
        for r in results}
    p90 = ", ".join(f"{r.name} {r.p90_ms:.4g}" for r in results)
    text = (f"Profiled by {PROG} from {recipe.source_file}{''.join(' ' + o for o in args.overrides)} on "
            f"{device_name}, {recipe.train.dtype}, {opts.samples} samples after {opts.warmup} warm-up passes. "
            f"cost_ms: TP=1 measured (median; p90 ms: {p90}){tp_text}")
    text += (". flops_per_sample: median; activation_bytes_per_sample: largest over the samples; "
             f"peak_tflops: {peak[1]}; sample_cost_ms: "
             + (("the first {} samples of the recipe's data".format(args.draw_from) if args.draw_from else
                 f"the {opts.samples} samples") + "' cost-model FLOPs at each module's timed ms per FLOP."
                if draws is not None else "left out (a sample without FLOPs in some module)."))
    mem = args.gpu_memory_gb
    if mem is None and opts.device.type == "cuda":
        mem = torch.cuda.get_device_properties(opts.device).total_memory / GIB
    p = recipe.parallel
    gpus = args.gpus or sum(m.dp * m.tp * m.pp for m in p.modules.values())
    return Profile(gpus=gpus, global_batch=args.global_batch or recipe.train.global_batch, modules=modules,
                   microbatch=recipe.train.micro_batch, gpus_per_node=args.gpus_per_node,
                   gpu_memory_gb=mem, peak_tflops=peak[0], description=text,
                   graph=ModuleGraph.from_roles({r.name: r.role for r in results}))


def sample_draws(results: list[ModuleResult], costs: dict[str, dict[int, float]],
                 data: dict[str, list[float]] | None = None) -> dict[str, tuple[float, ...]] | None:
    """Per-sample fwd+bwd ms at TP=1 of every module (``sample_cost_ms``): each timed sample's work
    by the runtime's cost model (``ModuleResult.work``, padding included: what the module computes,
    as reordering and emulation price it; not the useful FLOPs of MFU, whose spread over packed
    sequences is mostly padding) scaled so the module's mean is its C(1), time proportional to
    work, which keeps the measurement's noise out of the spread. With ``data`` (``--draw-from``:
    the work of many samples of the recipe's data) those samples at the same ms per unit of work.
    A sample with no work in a module (no images for an encoder, no targets for a generator) keeps
    its 0; a module no sample gives work has a draw of zeros. None when a module timed no sample."""
    if any(not r.work for r in results):
        return None
    out = {}
    for r in results:
        mean = statistics.fmean(r.work)
        work = r.work if data is None else data[r.name]
        if mean == 0 and any(w > 0 for w in work):
            raise ConfigError(f"--draw-from: no timed sample gave module {r.name} work to scale its costs by; "
                              "time more samples (--samples)")
        out[r.name] = tuple(f / mean * costs[r.name][1] if mean > 0 else 0.0 for f in work)
    return out


def unit_draws(draws: dict[str, tuple[float, ...]], units: dict[str, list[list[float]]]
               ) -> dict[str, tuple[tuple[float, ...], ...]]:
    """``unit_cost_ms`` of every module with unit costs: each sample's ms split over its units in
    proportion to their costs (so they add up to ``sample_cost_ms``)."""
    out = {}
    for name, per in units.items():
        out[name] = tuple(tuple(ms * u / sum(us) for u in us) if sum(us) > 0 else (0.0,) * len(us)
                          for ms, us in zip(draws[name], per))
    return out


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_report(results: list[ModuleResult], profile: Profile, cuda: bool, tp_text: str) -> str:
    """Human-readable per-module table and what its numbers mean."""
    lines = [f"{'module':<10} {'mode':<18} {'params':>7} {'median ms':>10} {'p90 ms':>9} "
             f"{'FLOPs/sample':>12} {'TFLOP/s':>8} {'mem MiB':>8}  cost_ms by TP"]
    for r in results:
        by_tp = " ".join(f"{t}:{c:.4g}" for t, c in sorted(profile.modules[r.name].cost_ms.items()))
        lines.append(f"{r.name:<10} {r.mode:<18} {_si(r.params):>7} {r.median_ms:>10.2f} {r.p90_ms:>9.2f} "
                     f"{_si(statistics.median(r.flops)):>12} {r.tflops:>8.3g} {r.memory_bytes / 2**20:>8.1f}  {by_tp}")
    lines.append("mem: " + ("peak allocated while timing (CUDA)" if cuda else
                            "estimate = weights + gradients + activations saved for backward"))
    if tp_text:
        lines.append("cost_ms:" + tp_text.removeprefix(";"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    ap = OneLineParser(prog=PROG, description="Measure each module of a recipe's model and write a "
                 "profile for the planner (disttrain-plan, or python -m disttrain_ds.cli.plan).")
    ap.add_argument("--recipe", required=True, type=Path, help="recipe: YAML path or shipped recipe name (tiny_cpu)")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. model.llm.layers=8")
    ap.add_argument("--samples", type=int, default=8, help="samples to time (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed passes per module first (default 2)")
    ap.add_argument("--draw-from", type=int, metavar="N",
                    help="sample_cost_ms from the first N samples of the recipe's data, priced by the cost model "
                         "and scaled by the timed samples' ms per unit of it (default: the timed samples)")
    ap.add_argument("--gpus", type=int, help="GPUs the plan may use (default: the recipe's layout)")
    ap.add_argument("--global-batch", type=int, help="default: the recipe's train.global_batch")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="bounds TP (default 8)")
    ap.add_argument("--tp-efficiency", type=float, default=0.9,
                    help="assumed efficiency per TP doubling for the interpolated TP>1 costs (default 0.9)")
    ap.add_argument("--measure-tp", type=int, nargs="+", default=[], metavar="T",
                    help="also measure these TP degrees (2, 4, 8), each with T processes (one GPU each)")
    ap.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (default: this GPU's; none on CPU)")
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU (default: table or CPU estimate)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", type=Path, default=Path("profile.json"), help="profile JSON to write")
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    return ap


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, or None."""
    for key, low in {"samples": 1, "warmup": 0, "gpus": 1, "global_batch": 1, "gpus_per_node": 1,
                     "draw_from": 1}.items():
        if getattr(args, key) is not None and getattr(args, key) < low:
            return f"--{key.replace('_', '-')} must be >= {low}, got {getattr(args, key)}"
    for key in ("gpu_memory_gb", "peak_tflops", "tp_efficiency"):
        if getattr(args, key) is not None and not getattr(args, key) > 0:  # NaN fails too
            return f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}"
    if args.tp_efficiency > 1:
        return f"--tp-efficiency must be <= 1, got {args.tp_efficiency}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available"
    for t in args.measure_tp:
        if t not in TP_DEGREES or t == 1:
            return f"--measure-tp: {t} is not one of 2, 4, 8"
        if t > args.gpus_per_node:
            return f"--measure-tp: {t} is above --gpus-per-node {args.gpus_per_node}"
        if args.device != "cpu" and torch.cuda.is_available() and t > torch.cuda.device_count():
            return f"--measure-tp: {t} needs {t} GPUs on this machine, it has {torch.cuda.device_count()}"
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
        measured = measure_tp(args, recipe, "cuda" if cuda else "cpu")
        tp_table = cost_table(recipe, {r.name: r.median_ms for r in results}, measured, args.tp_efficiency,
                              args.gpus_per_node)
        profile = build_profile(recipe, results, args, opts, name, peak, tp_table, frozenset(measured))
    except (ConfigError, torch.OutOfMemoryError) as exc:
        return _fail(str(exc).splitlines()[0])
    if args.out.exists() and not args.force:  # appeared while measuring
        return _fail(f"{args.out}: already exists (use --force to overwrite)")
    save_profile(profile, args.out)
    print(format_report(results, profile, cuda, tp_table[1]))
    print(f"wrote {args.out}; plan with: python -m disttrain_ds.cli.plan --profile {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

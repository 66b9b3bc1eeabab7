"""Emulated compute on CPU: the real runtime against the simulator, monolithic vs disaggregated.

    python bench/emulated.py --quick             # 8 ranks, one profile, no reordering (~3-4 min)
    python bench/emulated.py                     # 8 and 16 ranks, both profiles, +/- reordering
    python bench/emulated.py --quick --recipe tiny_vlm   # a module graph: vision -> llm, no generator
    python bench/emulated.py --quick --sp 2 --only sp2   # the disaggregated plan with the LLM at SP 2

Every configuration is a real ``torchrun`` job of ``tools/train.py`` (processes, rank groups,
communicator, 1F1B schedule, reordering, data producers, optimizer steps) with ``emulate.enabled``:
each forward/backward runs the tiny layers and then waits the time the cost model gives its
samples (``disttrain_ds/runtime/emulate.py``). The simulator is fed the very times the ranks
waited for, plus overheads measured from each run's last-step trace. Layouts: the monolithic
(Megatron-LM) layout with the best LLM pipeline degree, and the disaggregated plan of
``disttrain_ds.planner.optimize.plan``, both on a profile whose GPU count is the rank count.
The last line is ``measured/simulated iteration time: R, disaggregated/monolithic speedup: S``
(R: geometric mean over all runs; S: measured, without reordering, at the first rank count).
``--recipe tiny_vlm`` runs the understanding-only module graph instead (its modules by name; the
paper profile is the three-module model's, so only the CPU profile of the graph applies).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.cost.profile import Profile, ProfileError
from disttrain_ds.cost.profile_file import load_profile, profile_from_dict, profile_to_dict
from disttrain_ds.planner.baselines import megatron_plan  # noqa: E402
from disttrain_ds.planner.optimize import Plan, PlanError, plan  # noqa: E402
from disttrain_ds.schedule import replay  # noqa: E402

RECIPES = {"tiny_cpu": "recipes/tiny_cpu.yaml", "tiny_vlm": "recipes/tiny_vlm.yaml"}
# Data with per-sample variation (1-5 input images of 32-48 px, i.e. 16-36 patches each, and 1-3
# generated images per 256-token sequence) and a one-level U-Net, so that the real tiny layers
# stay well below the emulated times of even the lightest samples on a shared CPU.
IMAGES = ["data.source=synthetic", "data.seq_len=256", "data.image_sizes=[32,40,48]", "data.max_images=5"]
WORKLOADS = {
    "tiny_cpu": IMAGES + ["data.gen_images=[1,3]", "model.generator.block_out_channels=[8]",
                          "model.generator.down_block_types=[CrossAttnDownBlock2D]",
                          "model.generator.up_block_types=[CrossAttnUpBlock2D]",
                          "model.generator.attention_head_dim=[8]", "model.generator.norm_num_groups=4"],
    "tiny_vlm": IMAGES,
}
RECIPE, WORKLOAD = RECIPES["tiny_cpu"], WORKLOADS["tiny_cpu"]  # set by --recipe
TIME_SCALE = {"paper": 1.0, "cpu": 20.0}
"""Emulated time per profiled time: the paper's milliseconds as they are; the CPU profile's
tiny-layer milliseconds 20 times slower. Either way the real tiny layers take a small part of
every op, even for the lightest samples and with 16 ranks sharing two cores."""
MAX_MICROBATCHES = 8
"""Pipeline steps per iteration at most: up to 8 the inter-microbatch order is searched
exhaustively (and fast) by every rank's data producer; beyond, each spends a 1 s budget per batch."""
PROFILE_NAMES = {"paper": "MLLM-9B from the paper's Fig. 3", "cpu": "profiler on this machine"}
SHIPPED_CPU_PROFILE = REPO / "docs" / "benchmarks" / "profile_cpu.json"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}


class BenchError(Exception):
    """Reported as one line, exit code 2."""


# --------------------------------------------------------------------------- profiles


def paper_profile(paper_path: Path | None) -> Profile:
    """MLLM-9B from the paper's figures (``planner.scale``), TP=1 costs only, memory unchecked.

    ``paper_path`` None reads the figures shipped in ``disttrain_ds/paper``."""
    from disttrain_ds.data.paper_stats import draw_sequence_layouts
    from disttrain_ds.errors import ConfigError
    from disttrain_ds.paper import load_paper_figures, packaged_figures_name, scale

    try:
        paper = load_paper_figures(paper_path)
    except ConfigError as exc:
        raise BenchError(str(exc)) from None
    spec = scale.model_specs(paper)["MLLM-9B"]
    costs = scale.sample_costs(draw_sequence_layouts(256, 8192, np.random.default_rng(0)), spec, 8192)
    d = profile_to_dict(scale.build_profile(paper, spec, costs, gpus=8, global_batch=16))
    d.pop("gpu_memory_gb", None)
    return profile_from_dict(_tp1(d), src=str(paper_path or packaged_figures_name()))


def _tp1(d: dict) -> dict:
    """Tensor parallelism is not run here: keep TP=1 costs (gpus_per_node 1)."""
    for m in d["modules"].values():
        m["cost_ms"] = {"1": m["cost_ms"]["1"]}
        m["cost_source"] = {t: s for t, s in m.get("cost_source", {}).items() if t == "1"}
    return {**d, "gpus_per_node": 1}


def cpu_profile(path: Path | None, out: Path) -> Profile:
    """The profiler's measurement of the benchmark's tiny modules on this machine."""
    if path is None:
        path = out / "profile_cpu.json"
        cmd = [sys.executable, "-m", "disttrain_ds.cli.profile", "--recipe", RECIPE, *WORKLOAD, "--samples", "16",
               "--gpus", "8", "--global-batch", "16", "--gpus-per-node", "1", "--peak-tflops", "1",
               "--out", str(path), "--force"]
        print(f"profiling: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
        if proc.returncode:
            raise BenchError(f"profiler failed: {proc.stderr.strip().splitlines()[-1:]}")
    try:
        return profile_from_dict(_tp1(profile_to_dict(load_profile(path))), src=str(path))
    except ProfileError as exc:  # missing or malformed --cpu-profile
        raise BenchError(f"--cpu-profile: {exc}") from None


def at_scale(profile: Profile, ranks: int) -> tuple[Profile, dict[str, Plan]]:
    """The profile on ``ranks`` GPUs with the largest global batch, a multiple of 4 and at most 2
    per rank, for which both layouts run at most ``MAX_MICROBATCHES`` pipeline steps; the two plans."""
    for batch in range(2 * ranks - 2 * ranks % 4, 0, -4):
        p = profile_from_dict({**profile_to_dict(profile), "gpus": ranks, "global_batch": batch})
        try:
            plans = {"monolithic": monolithic_plan(p), "disaggregated": plan(p)}
        except (PlanError, BenchError):
            continue
        if max(x.microbatches for x in plans.values()) <= MAX_MICROBATCHES:
            return p, plans
    raise BenchError(f"no global batch gives both layouts at most {MAX_MICROBATCHES} microbatches on {ranks} ranks")


def monolithic_plan(profile: Profile) -> Plan:
    """Megatron-LM's layout at TP=1 with the LLM pipeline degree of least planned time (then fewest GPUs)."""
    best = None
    for pp in range(1, profile.modules[profile.graph.llm].layers + 1):
        try:
            p = megatron_plan(profile, tp=1, pp=pp)
        except PlanError:
            continue
        if best is None or (p.t_iter_ms, p.gpus) < (best.t_iter_ms, best.gpus):
            best = p
    if best is None:
        raise BenchError(f"no monolithic layout fits {profile.gpus} ranks")
    return best


# --------------------------------------------------------------------------- runs


@dataclass
class Config:
    """One benchmarked configuration."""

    profile: str
    ranks: int
    batch: int
    layout: str
    reorder: bool
    plan: Plan
    profile_path: Path
    reps: list[dict] = field(default_factory=list)
    post_balance: bool = False
    sp: int = 1
    """The LLM's sequence-parallel degree (its ranks times this)."""

    @property
    def name(self) -> str:
        return (f"{self.layout}{' + reorder' if self.reorder else ''}{' + post-balance' if self.post_balance else ''}"
                f"{f' + LLM SP {self.sp}' if self.sp > 1 else ''}")

    @property
    def slug(self) -> str:
        return (f"{self.profile}_{self.ranks}r_{self.layout[:4]}{'_reorder' if self.reorder else ''}"
                f"{'_post' if self.post_balance else ''}{f'_sp{self.sp}' if self.sp > 1 else ''}")

    @property
    def world(self) -> int:
        p = self.plan
        if self.layout == "monolithic":
            return p.llm.dp * (p.llm.pp + len(p.graph.names) - 1)
        return sum(p.module(m).dp * p.module(m).pp * (self.sp if m == p.graph.llm else 1) for m in p.graph.names)

    def overrides(self, run_dir: Path, steps: int, batch: int) -> list[str]:
        from disttrain_ds.recipe.graph import module_key, parallel_key
        from disttrain_ds.recipe.schema import load_recipe

        p, recipe = self.plan, load_recipe(REPO / RECIPE)
        llm = p.graph.llm
        out = [f"layout={self.layout}", f"{parallel_key(recipe, llm)}.dp={p.llm.dp}", f"{parallel_key(recipe, llm)}.pp={p.llm.pp}"]
        if self.layout == "disaggregated":
            out += [f"{parallel_key(recipe, m)}.{k}={getattr(p.module(m), k)}" for m in p.graph.names if m != llm
                    for k in ("dp", "pp")]
        out.append(f"{module_key(recipe, llm)}.layers={max(4, p.llm.pp)}")  # the tiny LLM needs a layer per stage
        return out + WORKLOAD + [
            f"train.global_batch={batch}", "train.micro_batch=1", f"train.steps={steps}", "train.peak_tflops=1",
            f"data.reorder={str(self.reorder).lower()}", "data.producers=1", f"data.queue_depth={steps}",
            "emulate.enabled=true",
            f"emulate.profile={self.profile_path}", f"emulate.time_scale={TIME_SCALE[self.profile]}",
            f"logging.dir={run_dir}", "logging.wandb=disabled", "logging.every=1000",
            "parallel.heartbeat_timeout_s=120", "parallel.comm_timeout_s=600",
            f"parallel.post_balance={str(self.post_balance).lower()}", f"{parallel_key(recipe, llm)}.sp={self.sp}"]


def launch(cfg: Config, run_dir: Path, steps: int, batch: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.world}",
           "tools/train.py", "--recipe", RECIPE, *cfg.overrides(run_dir, steps, batch)]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode:
        raise BenchError(f"{cfg.slug}: torchrun exited with {proc.returncode}; see {log}")


def analyse(run_dir: Path, warmup: int, slot: int) -> dict:
    """Per-step measured and simulated times of one run (steps after ``warmup``), medians."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = replay.load_records(run_dir / "emulate")
    spans = {int(f.stem[4:]): replay.read_trace(f) for f in (run_dir / "trace").glob("rank*.json")}
    last = rows[-1]["step"]
    stages = 1 + max(r.global_stage for r in recs[last])
    ov = replay.measure_overheads(spans, recs[last], slot)
    steps = [r for r in rows if r["step"] > warmup]
    meas = [1e3 * r["step_seconds"] for r in steps]
    pure = [replay.simulate_step(recs[r["step"]], stages)[0] for r in steps]
    full = [replay.simulate_ranks(recs[r["step"]], slot, ov)[0] for r in steps]
    return {"measured": statistics.median(meas), "pure": statistics.median(pure), "sim": statistics.median(full),
            "overheads": ov, "waits": replay.wait_summary(run_dir / "emulate"), "spans": spans,
            "last": recs[last], "slot": slot}


# --------------------------------------------------------------------------- output


def layout_text(cfg: Config) -> str:
    p = cfg.plan
    if cfg.layout == "monolithic":
        return " / ".join(f"{p.llm.dp}x{p.llm.pp if m == p.graph.llm else 1}" for m in p.graph.names)
    return " / ".join(f"{p.module(m).dp}x{p.module(m).pp}" for m in p.graph.names)


def median_of(cfg: Config, key: str) -> float:
    return statistics.median(r[key] for r in cfg.reps)


def print_table(cfgs: list[Config], scale_: float) -> None:
    names = " / ".join(cfgs[0].plan.graph.names)
    print(f"| configuration | {names} (dp x pp) | ranks | K | planner ms | simulated ms, lock-step, compute only | "
          "simulated ms, per replica + overheads | measured ms | measured / simulated | measured min-max | overruns |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cfgs:
        meas = [r["measured"] for r in c.reps]
        over = sum(r["waits"]["overruns"] for r in c.reps)
        print(f"| {c.name} | {layout_text(c)} | {c.world} | {c.plan.microbatches} | {c.plan.t_iter_ms * scale_:.0f} | "
              f"{median_of(c, 'pure'):.0f} | {median_of(c, 'sim'):.0f} | {median_of(c, 'measured'):.0f} | "
              f"{median_of(c, 'measured') / median_of(c, 'sim'):.3f} | {min(meas):.0f}-{max(meas):.0f} | {over:.0f} |")


def draw_gantt(cfg: Config, rep: dict, path: Path) -> None:
    """The last step of a run: measured spans per rank (top) above the simulated ops of the same
    ranks (bottom, per-replica simulator with the measured overheads), on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forward": "#4C72B0", "backward": "#DD8452", "send": "#55A868", "recv": "#DDDDDD",
               "load": "#8172B2", "allreduce": "#C44E52", "optimizer": "#937860"}
    spans, by_rank, ov = rep["spans"], {r.rank: r for r in rep["last"]}, rep["overheads"]
    t0 = min(sp[0]["start"] - by_rank[r].prep_ms for r, sp in spans.items() if sp)  # the step's start
    _, sim = replay.simulate_ranks(rep["last"], rep["slot"], ov)
    ranks = sorted(spans, key=lambda r: (by_rank[r].global_stage, by_rank[r].dp))
    row = {r: len(ranks) - 1 - k for k, r in enumerate(ranks)}
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(11, 1.4 + 0.36 * len(ranks)))
    for r in ranks:
        for x in spans[r]:
            axes[0].barh(row[r], x["end"] - x["start"], left=x["start"] - t0, height=0.8,
                         color=colours.get(x["name"], "#999999"))
    for e in sim:
        axes[1].barh(row[e["rank"]], e["end"] - e["start"], left=e["start"], height=0.8,
                     color=colours["forward" if e["name"] == "fwd" else "backward"])
    labels = [f"r{r} {by_rank[r].module[:6]} s{by_rank[r].global_stage} dp{by_rank[r].dp}" for r in reversed(ranks)]
    for ax, what in zip(axes, ("measured", "simulated")):
        ax.set_yticks(range(len(ranks)), labels, fontsize=6)
        ax.set_ylabel(what, fontsize=7)
        ax.tick_params(axis="x", labelsize=6)
    axes[0].set_title(f"{PROFILE_NAMES[cfg.profile]}, {cfg.ranks} ranks, {cfg.name}: one iteration", fontsize=8,
                      loc="left")
    axes[1].set_xlabel("ms since the step's start", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], list(colours), fontsize=6,
               loc="upper right", ncol=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)


def machine_line() -> str:
    import deepspeed
    import torch

    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"machine: {os.cpu_count()} CPUs ({cpu}), load average {load:.1f} at start; Python "
            f"{platform.python_version()}, torch {torch.__version__}, deepspeed {deepspeed.__version__}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 ranks, CPU profile, no reordering, 1 repetition")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="tiny_cpu",
                    help="the model: tiny_cpu (encoder -> llm -> generator) or tiny_vlm (vision -> llm)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--profiles", nargs="+", choices=sorted(TIME_SCALE), default=["paper", "cpu"])
    ap.add_argument("--reps", type=int, default=3, help="launches per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of each median")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per launch")
    ap.add_argument("--paper", type=Path, default=None, help="the paper's figures (JSON); default: the copy shipped in disttrain_ds/paper")
    ap.add_argument("--cpu-profile", type=Path, default=None,
                    help=f"profile to use instead of profiling (default: {SHIPPED_CPU_PROFILE.relative_to(REPO)} if present)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_emulated" / time.strftime("%Y%m%d-%H%M%S"),
                    help="run directories (must not exist yet)")
    ap.add_argument("--gantt-dir", type=Path, default=None, help="Gantt PNGs (default: OUT/gantt)")
    ap.add_argument("--only", default="", help="run only configurations whose name contains this (e.g. 16r_disa)")
    ap.add_argument("--sp", type=int, default=1,
                    help="also run every disaggregated configuration with the LLM at this SP degree (more ranks)")
    ap.add_argument("--post-balance", action="store_true",
                    help="also run every disaggregated configuration with parallel.post_balance")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.profiles, args.reps, args.steps = [8], ["cpu"], 1, 4
    global RECIPE, WORKLOAD
    RECIPE, WORKLOAD = RECIPES[args.recipe], WORKLOADS[args.recipe]
    shipped = SHIPPED_CPU_PROFILE if args.recipe == "tiny_cpu" and SHIPPED_CPU_PROFILE.is_file() else None
    cpu_path = args.cpu_profile or shipped
    if args.recipe != "tiny_cpu" and "paper" in args.profiles:
        raise BenchError(f"--recipe {args.recipe}: the paper profile is the three-module model's; use --profiles cpu")
    started = time.perf_counter()
    out = args.out
    if out.exists() and any(out.iterdir()):
        raise BenchError(f"--out {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    print(machine_line(), flush=True)
    profiles = {}
    for name in args.profiles:
        if name == "paper":
            profiles[name] = paper_profile(args.paper)
        else:
            profiles[name] = cpu_profile(cpu_path, out)
    if not profiles:
        raise BenchError("no profile to run")
    cfgs: list[Config] = []
    for name, prof in profiles.items():
        for n in args.ranks:
            p, plans = at_scale(prof, n)
            path = out / f"profile_{name}_{n}.json"
            path.write_text(json.dumps(profile_to_dict(p), indent=1))
            for layout in ("monolithic", "disaggregated"):
                for reorder in ((False,) if args.quick else (False, True)):
                    cfgs.append(Config(name, n, p.global_batch, layout, reorder, plans[layout], path))
                    if args.post_balance and layout == "disaggregated":
                        cfgs.append(Config(name, n, p.global_batch, layout, reorder, plans[layout], path,
                                           post_balance=True))
                    if args.sp > 1 and layout == "disaggregated":
                        cfgs.append(Config(name, n, p.global_batch, layout, reorder, plans[layout], path, sp=args.sp))
    cfgs = [c for c in cfgs if args.only in c.slug]
    if not cfgs:
        raise BenchError(f"--only {args.only!r} matches no configuration")
    steps = args.warmup + args.steps
    gantt_dir = args.gantt_dir or out / "gantt"
    for k in range(args.reps):  # repetitions interleaved, so a change in background load hits every configuration
        for c in cfgs:
            run_dir = out / c.slug / f"rep{k}"
            t = time.perf_counter()
            launch(c, run_dir, steps, c.batch)
            rep = analyse(run_dir, args.warmup, c.plan.llm.dp)
            c.reps.append(rep)
            print(f"{c.slug} rep {k}: measured {rep['measured']:.0f} ms, simulated {rep['sim']:.0f} ms "
                  f"(compute only {rep['pure']:.0f}), {rep['waits']['overruns']:.0f} overruns, "
                  f"{time.perf_counter() - t:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
            if k == 0:
                draw_gantt(c, rep, gantt_dir / f"gantt_{c.slug}.png")
    print()
    for name in profiles:
        for n in args.ranks:
            group = [c for c in cfgs if c.profile == name and c.ranks == n]
            print(f"### {PROFILE_NAMES[name]}, time x{TIME_SCALE[name]:g}: {n} ranks, global batch {group[0].batch}, "
                  f"median of {args.reps} launch(es) x {args.steps} steps after {args.warmup} warm-up\n")
            print_table(group, TIME_SCALE[name])
            print()
            for reorder in sorted({c.reorder for c in group}):
                pair = {c.layout: c for c in group if c.reorder == reorder and not c.post_balance}
                if len(pair) < 2:
                    continue
                mono, dis = pair["monolithic"], pair["disaggregated"]
                print(f"disaggregated/monolithic speedup{' with reordering' if reorder else ''}: measured "
                      f"{median_of(mono, 'measured') / median_of(dis, 'measured'):.3f}, simulated "
                      f"{median_of(mono, 'sim') / median_of(dis, 'sim'):.3f}, planner "
                      f"{mono.plan.t_iter_ms / dis.plan.t_iter_ms:.3f}")
            for reorder in sorted({c.reorder for c in group}):
                pair = [c for c in group if c.layout == "disaggregated" and c.reorder == reorder]
                if len(pair) == 2:
                    print(f"post-balancing gain{' with reordering' if reorder else ''}: measured "
                          f"{median_of(pair[0], 'measured') / median_of(pair[1], 'measured'):.3f}, "
                          f"simulated {median_of(pair[0], 'sim') / median_of(pair[1], 'sim'):.3f}")
            for layout in ("monolithic", "disaggregated"):
                pair = [c for c in group if c.layout == layout and not c.post_balance]
                if len(pair) == 2:
                    print(f"reordering gain, {layout}: measured {median_of(pair[0], 'measured') / median_of(pair[1], 'measured'):.3f}, "
                          f"simulated {median_of(pair[0], 'sim') / median_of(pair[1], 'sim'):.3f}")
            print()
    ratios = [r["measured"] / r["sim"] for c in cfgs for r in c.reps]
    r_all = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    first = {c.layout: c for c in cfgs
             if (c.profile, c.ranks, c.reorder, c.post_balance) == (cfgs[0].profile, cfgs[0].ranks, False, False)}
    s = (f"{median_of(first['monolithic'], 'measured') / median_of(first['disaggregated'], 'measured'):.3f}"
         if len(first) == 2 else "n/a")
    print(f"Gantt charts: {gantt_dir}; runs: {out}; total {time.perf_counter() - started:.0f} s")
    print(f"measured/simulated iteration time: {r_all:.3f}, disaggregated/monolithic speedup: {s}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"bench/emulated.py: error: {exc}", file=sys.stderr)
        sys.exit(2)

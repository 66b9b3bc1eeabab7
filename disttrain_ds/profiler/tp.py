"""Measured tensor-parallel costs C(TP) for the profiler (``--measure-tp 2 4 8``).

For each degree ``t`` the profiler starts ``t`` processes with torchrun (one GPU each, NCCL; gloo on
the CPU). Every rank builds each module from the same seeded layers, keeps its Megatron-style
shards (``parallel/tensor_parallel.py``, the runtime's own), and times the same samples as the
TP=1 run; ranks start every pass together and a pass costs what its slowest rank took. Rank 0
writes the per-module medians as JSON. A module whose sizes ``t`` does not divide is skipped: the
runtime refuses that degree, so the profile leaves it out and the planner never picks it.

    torchrun --standalone --nproc_per_node=T -m disttrain_ds.profiler.tp OUT.json --recipe R.yaml \\
        [key=value ...] --samples N --warmup W --device cpu|cuda
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

from disttrain_ds.cost.profile import TP_DEGREES
from disttrain_ds.cost.tp_scaling import tp_scaled
from disttrain_ds.errors import ConfigError
from disttrain_ds.parallel.tensor_parallel import TPContext, shard_layer
from disttrain_ds.parallel.tp_sequence import TPSeqContext, attach
from disttrain_ds.profiler.measure import Options, profile_recipe
from disttrain_ds.recipe.graph import graph_of, sliced_tp_chunks
from disttrain_ds.recipe.schema import Recipe, load_recipe, tp_shape_problem

WORKER_TIMEOUT_S = 3600


def cost_table(recipe: Recipe, c1: dict[str, float], measured: dict[int, dict[str, float]], efficiency: float,
               gpus_per_node: int) -> tuple[dict[str, dict[int, float]], str]:
    """cost_ms per module and TP degree, and the sentence for the profile's description.

    TP=1 and the degrees in ``measured`` as measured; any other degree up to ``gpus_per_node``
    scaled from the largest measured degree b below it: C(t) = C(b) / ((t/b) * efficiency^log2(t/b));
    degrees a module's sizes do not split left out (the runtime refuses them).
    """
    costs: dict[str, dict[int, float]] = {}
    dropped: list[str] = []
    for m in graph_of(recipe).names:
        row = {1: c1[m]}
        for t in (t for t in TP_DEGREES if 1 < t <= gpus_per_node):
            problem = tp_shape_problem(recipe, m, t)
            if problem is not None:
                dropped.append(f"{m} TP={t} ({problem[0]})")
            elif t in measured:
                row[t] = measured[t][m]
            else:
                b = max(d for d in row if d < t and (d == 1 or d in measured))
                row[t] = tp_scaled(row[b], b, t, efficiency)
        costs[m] = row
    text = ""
    if measured:
        degrees = "/".join(map(str, sorted(measured)))
        text += f"; TP={degrees} measured with as many processes (median over samples of the slowest rank)"
    interp = [t for t in TP_DEGREES if 1 < t <= gpus_per_node and t not in measured]
    if interp and measured:
        text += (f"; TP={'/'.join(map(str, interp))} interpolated, not measured: C(t) = C(b) / ((t/b) * "
                 f"{efficiency}^log2(t/b)) from the largest measured degree b below t")
    elif interp:
        text += f"; TP={'/'.join(map(str, interp))} interpolated, not measured: C(t) = C(1) / (t * {efficiency}^log2 t)"
    if dropped:
        text += f"; left out, sizes do not split: {', '.join(dropped)}"
    return costs, text


def measure_tp(args: argparse.Namespace, recipe: Recipe, device_kind: str) -> dict[int, dict[str, float]]:
    """Module medians for each degree in ``args.measure_tp`` (modules a degree does not split: absent)."""
    out = {}
    for t in args.measure_tp:
        sliced = [m for m in graph_of(recipe).names if sliced_tp_chunks(recipe, m, t, device_kind == "cuda")]
        print(f"measuring TP={t} with {t} processes" + (f" ({', '.join(sliced)} on sequence slices, collectives "
                                                        "overlapped)" if sliced else ""), file=sys.stderr)
        with tempfile.TemporaryDirectory() as d:
            out[t] = measure(args, t, device_kind, Path(d) / "tp.json")
    return out


def worker_error(output: str) -> str:
    """The line of the workers' output that says what failed: the last exception a worker raised
    (torchrun's own summary lines, ``error_file: <N/A>`` and the like, say nothing)."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    raised = [x for x in lines if re.search(r"\b\w*(Error|Exception|Interrupt)\b:", x) and "error_file" not in x
              and "ChildFailedError" not in x]
    return (raised or [x for x in lines if "error" in x.lower() and "error_file" not in x] or lines or ["no output"])[-1]


def measure(args: argparse.Namespace, tp: int, device_kind: str, out: Path) -> dict[str, float]:
    """Run the ``tp`` workers; per module the median ms per sample (modules that do not split: absent)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
           "-m", "disttrain_ds.profiler.tp", str(out), "--recipe", str(args.recipe), *args.overrides,
           "--samples", str(args.samples), "--warmup", str(args.warmup), "--device", device_kind]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--measure-tp {tp}: the {tp} worker processes did not finish within "
                          f"{WORKER_TIMEOUT_S} s") from None
    if proc.returncode or not out.is_file():
        raise ConfigError(f"--measure-tp {tp}: worker processes failed (exit {proc.returncode}): "
                          f"{worker_error(proc.stderr + proc.stdout)}")
    return {m: float(v) for m, v in json.loads(out.read_text())["median_ms"].items()}


def _worker(argv: list[str]) -> int:
    import torch.distributed as dist

    # deferred: loads deepspeed
    from disttrain_ds.runtime.startup import device_index

    ap = argparse.ArgumentParser(prog="python -m disttrain_ds.profiler.tp")
    ap.add_argument("out", type=Path)
    ap.add_argument("--recipe", required=True, type=Path)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_intermixed_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=600))
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    recipe = load_recipe(args.recipe, args.overrides)
    tp = TPContext(dist.group.WORLD, rank, size, 0)
    sync_on = torch.zeros(1, device=device)

    def sync() -> None:  # every rank starts the timed pass together
        dist.all_reduce(sync_on)
        if cuda:
            torch.cuda.synchronize(device)

    dtype = torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32
    # Modules on sequence slices where the runtime would run them so (``tp_overlap``): that cost is the one timed.
    tp_seq = {m: TPSeqContext(tp, chunks) if (chunks := sliced_tp_chunks(recipe, m, size, cuda)) else None
              for m in graph_of(recipe).names}
    opts = Options(args.samples, args.warmup, device, dtype,
                   build=lambda m, d: attach(shard_layer(d.build(), tp), tp_seq[m]), sync=sync)
    skip = frozenset(m for m in graph_of(recipe).names if tp_shape_problem(recipe, m, size))
    medians = {}
    for r in profile_recipe(recipe, opts, whole=skip):
        if r.name in skip:
            continue
        slowest = torch.tensor(r.times_ms, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a TP pass lasts as long as its slowest rank
        medians[r.name] = statistics.median(slowest.tolist())
    if rank == 0:
        args.out.write_text(json.dumps({"tp": size, "median_ms": medians}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))

"""Communication wait and step time of this checkout against another one, side by side.

    git worktree add ../baseline <rev>
    python bench/ab_comm_wait.py --baseline ../baseline [--rounds 2] [-- extra bench/emulated.py args]

Runs ``bench/emulated.py`` (emulated compute, real runtime; by default ``--quick``: 8 ranks, the
shipped CPU profile, monolithic and disaggregated) from each checkout in turn, ``--rounds`` times,
alternating so background load hits both alike, and reads every run's ``metrics.jsonl``: per
configuration, the median over measured steps of ``time/comm_wait`` (mean over ranks of the time
spent waiting on the inter-engine communicator), of the worst module's wait, and of ``time/step``.
Both checkouts run under this environment: set ``DISTTRAIN_NCCL_EMULATION=1`` to hold both to
NCCL's rules (a baseline that breaks them then fails to run, which is the point of such a change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ("encoder", "llm", "generator")


class BenchError(Exception):
    """Reported as one line, exit code 2."""


def run_tree(tree: Path, out: Path, extra: list[str]) -> None:
    cmd = [sys.executable, str(tree / "bench" / "emulated.py"), "--out", str(out), *extra]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=tree, stdout=f, stderr=subprocess.STDOUT, env=os.environ)
    if proc.returncode:
        raise BenchError(f"{tree}: bench/emulated.py exited with {proc.returncode}; see {log}")


def step_figures(out: Path, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Configuration -> figure -> per-step values (ms) over every repetition's measured steps."""
    figs: dict[str, dict[str, list[float]]] = {}
    for metrics in sorted(out.glob("*/rep*/metrics.jsonl")):
        cfg = metrics.parent.parent.name
        d = figs.setdefault(cfg, {"comm_wait": [], "worst_module_wait": [], "step": []})
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if r["step"] <= warmup:
                continue
            d["comm_wait"].append(1e3 * r["time/comm_wait"])
            d["worst_module_wait"].append(1e3 * max(r[f"time/{m}_comm_wait"] for m in MODULES))
            d["step"].append(1e3 * r["time/step"])
    return figs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout of this repository")
    ap.add_argument("--rounds", type=int, default=2, help="runs per checkout, alternating")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out (as bench/emulated.py)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "ab_comm_wait" / time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("extra", nargs="*", help="arguments for bench/emulated.py (default: --quick with the shipped CPU profile)")
    args = ap.parse_args(argv)
    try:
        if not (args.baseline / "bench" / "emulated.py").is_file():
            raise BenchError(f"--baseline {args.baseline}: not a checkout of this repository (no bench/emulated.py)")
        extra = args.extra or ["--quick", "--cpu-profile", "docs/benchmarks/profile_cpu.json"]
        trees = {"baseline": args.baseline.resolve(), "this": REPO}
        for k in range(args.rounds):
            for name, tree in trees.items():
                print(f"round {k + 1}/{args.rounds}: {name} ({tree})", flush=True)
                run_tree(tree, args.out / name / f"round{k}", extra)
        figs = {name: {} for name in trees}
        for name in trees:
            for rnd in sorted((args.out / name).glob("round*")):
                if rnd.is_dir():
                    for cfg, d in step_figures(rnd, args.warmup).items():
                        acc = figs[name].setdefault(cfg, {k: [] for k in d})
                        for key, vals in d.items():
                            acc[key] += vals
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\nmedians over measured steps, ms (baseline -> this checkout)")
    print(f"{'configuration':<28} {'comm wait / rank':>22} {'worst module wait':>22} {'step time':>22}")
    for cfg in sorted(figs["this"]):
        cells = []
        for key in ("comm_wait", "worst_module_wait", "step"):
            a = statistics.median(figs["baseline"].get(cfg, {}).get(key) or [float("nan")])
            b = statistics.median(figs["this"][cfg][key])
            cells.append(f"{a:9.1f} -> {b:9.1f}")
        print(f"{cfg:<28} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

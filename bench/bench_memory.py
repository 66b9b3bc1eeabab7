"""Estimated vs measured peak memory per module, tiny recipes in several layouts (torchrun on CPU).

    python bench/bench_memory.py [--steps 3] [--layouts NAME ...] [--phases] [--glibc-default]

Each layout runs twice (ZeRO-1 once, see ``WHOLE``), the tiny recipe scaled up (``SCALED``: a wider LLM, longer sequences) and
the plain tiny recipe, each one torchrun job under the NCCL-semantics emulation with every rank
started by ``bench/memory_probe.py``. A rank's figures are taken above its own baseline (its
memory once every library is imported, before the recipe is read), and the plain recipe's are
subtracted from the scaled one's, which leaves the model's share (what the estimate counts)
without what the runtime's threads, code pages and buffers add whatever the model. The estimate
(``estimate/memory.py``, the formula the planner uses) is differenced the same way. Per module,
the rank with the most:

* ``live``: the most bytes the C allocator had handed out at once (sampled every millisecond;
  the CPU's counterpart of ``torch.cuda.max_memory_allocated``, what the estimate models);
* ``rss``: peak resident memory (what ``memory/<module>_peak_gib`` reports on CPU).

Jobs run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``): glibc by
default raises the threshold after the first large block is freed and then keeps freed tensors in
its heaps, so peak resident memory holds every tensor ever freed as well as the live ones (up to
twice the live peak, measured); ``--glibc-default`` measures that instead. ``--phases`` prints, for
the largest rank of each module, how much construction, engine set-up, forward, backward, the DP
reduce and the optimizer step each raised its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCALED = ["model.llm.hidden_size=256", "model.llm.ffn_hidden=512", "data.seq_len=512"]
"""The tiny recipe with a wider LLM and longer sequences, so the model's memory stands out of the
process baseline."""

DP2 = ["parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"]
LAYOUTS = {  # name: (ranks, overrides)
    "README (LLM PP 2)": (4, ["layout=disaggregated"]),
    "LLM TP 2": (4, ["layout=disaggregated", "parallel.llm.tp=2", "parallel.llm.pp=1"]),
    "LLM TP 2 x PP 2": (6, ["layout=disaggregated", "parallel.llm.tp=2"]),
    "LLM DP 2": (5, ["layout=disaggregated", *DP2]),
    "LLM PP 2, ckpt 1": (4, ["layout=disaggregated", "parallel.llm.activation_checkpointing=1"]),
    "LLM DP 2, ZeRO-1": (5, ["layout=disaggregated", *DP2, "deepspeed_config=ds_configs/zero1.json"]),
}
WHOLE = {"LLM DP 2, ZeRO-1"}
"""Layouts compared above each rank's baseline without subtracting the plain recipe: ZeRO-1's
gradient buckets do not depend on the model, so the difference would cancel them."""
PHASES = ("construction", "engine", "forward", "backward", "reduce", "step")
MIB = 2**20


def measured(ranks: int, overrides: list[str], steps: int, glibc_default: bool) -> dict[int, dict]:
    """Each rank's probe record (``bench/memory_probe.py``) of one torchrun job."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(REPO / "bench" / "memory_probe.py"), "--recipe", "tiny_cpu", f"logging.dir={tmp}/run",
               f"train.steps={steps}", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
               "DISTTRAIN_NCCL_EMULATION": "1", "PYTHONPATH": str(REPO), "PROBE_DIR": tmp}
        if not glibc_default:
            env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
        return {r: json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)}


def above_baseline(rec: dict) -> tuple[float, float]:
    """(live, rss) bytes of one rank above its baseline."""
    base = rec["baseline"]
    return max(rec["live"].values()) - base["live"], rec["peak"] - base["rss"]


def modules_of(overrides: list[str]) -> dict[str, range]:
    """Global ranks of each module."""
    from disttrain_ds.recipe.graph import topology_of
    from disttrain_ds.recipe.schema import load_recipe

    topo = topology_of(load_recipe("tiny_cpu", overrides))
    return {g.name: range(g.rank(stage=0, dp=0), g.rank(stage=g.pp - 1, dp=g.dp - 1, tp=g.tp - 1) + 1)
            for g in topo.modules}


def estimated(overrides: list[str]) -> dict[str, float]:
    """Largest per-rank estimate of each module, bytes."""
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.recipe.schema import load_recipe

    out: dict[str, float] = {}
    for row in estimate(load_recipe("tiny_cpu", overrides)):
        out[row.module] = max(out.get(row.module, 0.0), row.total)
    return out


RESOLVED = 2 * MIB
"""Differences below this are left without an error: the scaled recipe widens only the LLM, so
the other modules differ by their projector's LLM side alone, less than sampling resolves."""


def _err(e: float, m: float) -> str:
    return f"{100 * (e - m) / m:+.0f}%" if m > 0 and e >= RESOLVED else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--phases", action="store_true", help="what raised the peak of each module's largest rank")
    ap.add_argument("--glibc-default", action="store_true", help="glibc's own mmap threshold (keeps freed tensors)")
    args = ap.parse_args()
    print("(layouts in WHOLE: above each rank's baseline, the plain recipe not subtracted)")
    print(f"{'layout':<18} {'module':<10} {'live MiB':>9} {'rss MiB':>8} {'estimate':>9} {'vs live':>8} "
          f"{'vs rss':>7}", flush=True)
    for name in args.layouts:
        ranks, overrides = LAYOUTS[name]
        whole = name in WHOLE
        big = measured(ranks, SCALED + overrides, args.steps, args.glibc_default)
        small = None if whole else measured(ranks, overrides, args.steps, args.glibc_default)
        eb = estimated(SCALED + overrides)
        es = {m: 0.0 for m in eb} if whole else estimated(overrides)
        for module, where in modules_of(overrides).items():
            diff = {r: [a - (0.0 if whole else b) for a, b in zip(above_baseline(big[r]), above_baseline(
                (small or big)[r]))] for r in where}
            top = max(where, key=lambda r: diff[r][0])
            live, rss = diff[top][0], max(d[1] for d in diff.values())
            e = eb[module] - es[module]
            print(f"{name:<18} {module:<10} {live / MIB:>9.1f} {rss / MIB:>8.1f} {e / MIB:>9.1f} "
                  f"{_err(e, live):>8} {_err(e, rss):>7}", flush=True)
            if args.phases:
                raised = big[top]["raised"]
                print(f"{'':<18} rank {top} raised its peak (MiB): " + ", ".join(
                    f"{p} {raised.get(p, 0) / MIB:.1f}" for p in PHASES), flush=True)


if __name__ == "__main__":
    main()

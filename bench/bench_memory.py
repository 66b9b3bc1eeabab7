"""Estimated vs measured peak memory per module, tiny recipes in several layouts (torchrun on CPU).

    python bench/bench_memory.py [--steps 3] [--layouts NAME ...]

What is measured: the runtime's ``memory/<module>_peak_gib``, on CPU a process's peak resident
memory (torch's CPU allocator keeps no statistics of its own), as the largest over the module's
ranks. Resident memory includes Python, torch and DeepSpeed (about 0.45-0.5 GiB), so each layout
runs twice: the tiny recipe scaled up (``SCALED``) and the plain tiny recipe; the figure is the
difference, and the estimate (``runtime/memory.py``, the same formula the planner uses) is
differenced the same way. Each run is one torchrun job under the NCCL-semantics emulation.
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

LAYOUTS = {  # name: (ranks, overrides)
    "LLM PP 2": (4, ["layout=disaggregated"]),
    "LLM DP 2": (5, ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1",
                     "parallel.generator.dp=2"]),
    "LLM TP 2": (4, ["layout=disaggregated", "parallel.llm.tp=2", "parallel.llm.pp=1"]),
}


def measured(ranks: int, overrides: list[str], steps: int) -> dict[str, float]:
    """Peak GiB per module over the run's steps (the runtime's ``memory/<module>_peak_gib``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(REPO / "tools" / "train.py"), "--recipe", "tiny_cpu", f"logging.dir={tmp}/run",
               f"train.steps={steps}", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
               "DISTTRAIN_NCCL_EMULATION": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r if k.startswith("memory/") and k.endswith("_peak_gib")}
    return {k.split("/")[1].removesuffix("_peak_gib"): max(r.get(k, 0.0) for r in rows) for k in keys}


def estimated(overrides: list[str]) -> dict[str, float]:
    """Largest per-rank estimate of each module, GiB."""
    from disttrain_ds.config import load_recipe
    from disttrain_ds.runtime.memory import GIB, estimate

    out: dict[str, float] = {}
    for row in estimate(load_recipe("tiny_cpu", overrides)):
        out[row.module] = max(out.get(row.module, 0.0), row.total / GIB)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = ap.parse_args()
    print(f"{'layout':<18} {'module':<10} {'measured GiB':>12} {'estimated GiB':>13} {'error':>7}")
    for name in args.layouts:
        ranks, overrides = LAYOUTS[name]
        big, small = measured(ranks, SCALED + overrides, args.steps), measured(ranks, overrides, args.steps)
        eb, es = estimated(SCALED + overrides), estimated(overrides)
        for module in eb:
            m, e = big[module] - small[module], eb[module] - es[module]
            err = f"{100 * (e - m) / m:+.0f}%" if m > 0 else "-"
            print(f"{name:<18} {module:<10} {m:>12.3f} {e:>13.3f} {err:>7}", flush=True)


if __name__ == "__main__":
    main()

"""Reordering that keeps every sample on its host vs unconstrained reordering, on the paper's
LAION-400M statistics (:mod:`disttrain_ds.data.paper_stats`), priced by the paper's MLLM.

    python bench/bench_host_reorder.py [--batches N] [--batch B] [--groups G] [--per-group K] [--seed S]

For each host layout (which of a slot's DP groups each host reads) it prints, averaged over the
batches: the simulated 1F1B makespan relative to no reordering, the DP imbalance (slowest group's
summed cost over the mean, per microbatch) and the search time, side by side for no reordering,
the host-constrained order (also keeping the loader's microbatches: the constraint's cost alone)
and the unconstrained one.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_ds.cost.graph_costs import as_graph_costs  # noqa: E402
from disttrain_ds.data.paper_stats import draw_sample_stats  # noqa: E402
from disttrain_ds.reorder.inter import _span, batch_order  # noqa: E402


def split_of(order: list[int], groups: int, per_group: int) -> list[list[list[int]]]:
    slot = groups * per_group
    return [[order[j * slot + r * per_group: j * slot + (r + 1) * per_group] for r in range(groups)]
            for j in range(len(order) // slot)]


def imbalance(total: np.ndarray, split) -> float:
    return float(np.mean([max(total[g].sum() for g in mb) / np.mean([total[g].sum() for g in mb]) for mb in split]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--groups", type=int, default=4, help="DP groups per microbatch slot")
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model, g, k = as_graph_costs(None), a.groups, a.per_group
    slot = g * k
    layouts = {
        f"2 hosts, {g // 2} groups each": [h for h in range(2) for _ in range(slot // 2)],
        f"{g} hosts, 1 group each": [r for r in range(g) for _ in range(k)],
        "2 hosts, alternate samples": [i % 2 for i in range(slot)],
    }
    rng = np.random.default_rng(a.seed)
    batches = [model.costs(draw_sample_stats(a.batch, a.seq_len, rng)) for _ in range(a.batches)]
    print(f"{a.batches} batches of {a.batch}, {g} DP groups x {k} samples per microbatch, paper MLLM costs\n")
    print("| layout | order | makespan / none | DP imbalance (max/mean) | search s |")
    print("|---|---|---|---|---|")
    for name, lab in layouts.items():
        labels = lab * (a.batch // slot)
        rows: dict[str, list] = {"none": [], "host, loader's microbatches": [], "host-constrained": [],
                                 "unconstrained": []}
        for pm in batches:
            total = pm.sum(axis=1)
            base = _span(pm, model, split_of(list(range(a.batch)), g, k))
            runs = (("none", "skip", True), ("host, loader's microbatches", labels, False),
                    ("host-constrained", labels, True), ("unconstrained", None, True))
            for order_name, labs, regroup in runs:
                t0 = time.perf_counter()
                order = list(range(a.batch)) if labs == "skip" else batch_order(pm, model, g, k, labs, math.inf, regroup)
                dt = time.perf_counter() - t0
                split = split_of(order, g, k)
                rows[order_name].append((_span(pm, model, split) / base, imbalance(total, split), dt))
        for order_name, vals in rows.items():
            m = np.mean(vals, axis=0)
            print(f"| {name} | {order_name} | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.2f} |")


if __name__ == "__main__":
    main()

"""Per-module post-balancing against one order for every module: replica loads and simulated step time.

    python bench/bench_post_balance.py [--batches N] [--seed S]

Workloads (per-sample costs of ViT-H/14, Llama-3 7B and SD 2.1 in FLOPs, ``CostModel.paper_mllm``):

* ``paper``: the LAION-400M statistics of :mod:`disttrain_ds.data.paper_stats` (the paper's Fig. 3
  profile: every image of a sequence is also generated);
* ``mixed``: the same sequences where only some samples generate: none for 60 % of them, otherwise
  a geometric count (p = 0.35, at most 8) of 512 px targets, so the encoder's and the generator's
  heavy samples are different ones (the case one order cannot serve).

Layouts: LLM DP 8 x micro_batch 4 (a 32-sample slot), encoder and generator on 4 or 8 replicas.
Each global batch is first reordered as the runtime does with ``data.reorder`` (``reorder/inter.py``:
microbatches, a DP split by summed cost refined module by module, the 1F1B order); then

* ``one order``: every module takes contiguous, equal blocks of that order (today's default);
* ``post-balanced``: the encoder splits the slot's images and the generator its target images, each
  by its own costs (``reorder/post_balance.py``, at most 2 x the even share per replica, a unit
  leaving its block's replica only where balance needs it, as ``runtime/placement.py`` does), the
  LLM keeps its blocks.

Figures per module: the mean over slots of its slowest replica's load over the mean load, and the
same for the lower bound (``reorder.post_balance.lower_bound``: no assignment does better), and
the share of units placed away from their block's replica (each one couples two replicas across
the boundary). Step time: 1F1B
over encoder -> LLM (2 stages) -> generator with each stage's time its slowest replica's load, each
module's times scaled so its mean per-microbatch time equals an LLM stage's (a balanced
orchestration's sizing, leaving only data heterogeneity), backward = 2 x forward.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.comm.routes import blocks  # noqa: E402
from disttrain_ds.cost.graph_costs import GraphCosts  # noqa: E402
from disttrain_ds.cost.model import CostModel  # noqa: E402
from disttrain_ds.data.paper_stats import draw_sample_stats  # noqa: E402
from disttrain_ds.reorder.inter import batch_order  # noqa: E402
from disttrain_ds.reorder.post_balance import assign, lower_bound, share_cap  # noqa: E402
from disttrain_ds.samples import SampleStats  # noqa: E402
from disttrain_ds.schedule.simulate import makespan_1f1b  # noqa: E402

SEQ, PATCH, SLOT, LLM_DP, MICRO = 8192, 14, 32, 8, 4
COSTS = GraphCosts.three_module(CostModel.paper_mllm())
NAMES = ("encoder", "llm", "generator")


def workload(name: str, n: int, rng: np.random.Generator) -> list[SampleStats]:
    stats = draw_sample_stats(n, SEQ, rng, patch_size=PATCH)
    if name == "paper":
        return stats
    gens = [0 if rng.random() < 0.6 else min(8, int(rng.geometric(0.35))) for _ in stats]
    return [replace(s, gens=((g, 512),)) for s, g in zip(stats, gens)]


def unit_costs(stats: list[SampleStats], module: str) -> np.ndarray:
    """Each unit's forward FLOPs: an encoder's images, a generator's target images, in slot order."""
    if module == "encoder":
        return np.array([COSTS.module_cost("encoder", SampleStats(0, (n,), 0)) for s in stats for n in s.image_patches])
    return np.array([COSTS.module_cost("generator", SampleStats(0, (), 0, gens=((1, s.gen(0)[1]),)))
                     for s in stats for _ in range(s.gen(0)[0])])


def loads(costs: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    return np.array([costs[g].sum() for g in groups])


def run(name: str, dps: dict[str, int], batches: int, seed: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    slots = 8  # microbatches per global batch
    out: dict[str, list[float]] = {k: [] for k in ("enc_one", "enc_post", "enc_lb", "gen_one", "gen_post", "gen_lb",
                                                     "span_one", "span_post", "ms_per_slot", "enc_moved", "gen_moved")}
    groups_n = math.lcm(*dps.values())
    for _ in range(batches):
        stats = workload(name, SLOT * slots, rng)
        per = COSTS.costs(stats)  # [n, 3] forward FLOPs
        order = batch_order(per, COSTS, groups_n, SLOT // groups_n)
        per, stats = per[order], [stats[i] for i in order]
        stage = {k: np.zeros((slots, 3)) for k in ("one", "post")}
        for g in range(slots):
            c = per[g * SLOT:(g + 1) * SLOT]
            # The encoder's units are images, the generator's target images (the runtime's units).
            mine = stats[g * SLOT:(g + 1) * SLOT]
            unit = {"encoder": unit_costs(mine, "encoder"), "generator": unit_costs(mine, "generator"), "llm": c[:, 1]}
            counts = {"encoder": [len(s.image_patches) for s in mine], "generator": [s.gen(0)[0] for s in mine]}
            t0 = time.perf_counter()
            post = {"llm": [list(b) for b in blocks(SLOT, dps["llm"])]}
            for m in ("encoder", "generator"):
                n, dp = len(unit[m]), dps[m]
                home = [b for b, part in enumerate(blocks(SLOT, dp)) for i in part for _ in range(counts[m][i])]
                cap = share_cap(n, dp, 2.0)
                post[m] = assign(unit[m], dp, 0, cap, home=home if max(np.bincount(home, minlength=dp)) <= cap else None)
                out[f"{m[:3]}_moved"].append(sum(home[i] != r for r, g in enumerate(post[m]) for i in g) / max(n, 1))
            out["ms_per_slot"].append(1e3 * (time.perf_counter() - t0))
            for j, m in enumerate(NAMES):
                one = loads(c[:, j], [list(b) for b in blocks(SLOT, dps[m])])
                units = unit[m]
                bal = loads(units, post[m])
                stage["one"][g, j], stage["post"][g, j] = one.max(), bal.max()
                if m != "llm" and one.mean() > 0:
                    key = m[:3]
                    out[f"{key}_one"].append(one.max() / one.mean())
                    out[f"{key}_post"].append(bal.max() / bal.mean())
                    out[f"{key}_lb"].append(lower_bound(units, dps[m]) / one.mean())
        # Scale each module's stage times so its mean equals one LLM stage's (LLM on 2 stages).
        llm_mean = stage["one"][:, 1].mean() / 2
        for k, st in stage.items():
            scale = [stage["one"][:, j].mean() / llm_mean if stage["one"][:, j].mean() > 0 else 1.0 for j in range(3)]
            f = np.column_stack([st[:, 0] / scale[0], st[:, 1] / 2, st[:, 1] / 2, st[:, 2] / scale[2]]) / llm_mean
            out[f"span_{k}"].append(makespan_1f1b(f, 2 * f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| workload | encoder / generator replicas | encoder max/mean: one order, post-balanced, bound | "
          "generator max/mean: one order, post-balanced, bound | step time: post-balanced / one order | "
          "units off their block's replica: encoder, generator | assignment ms per slot |")
    print("|---|---|---|---|---|---|---|")
    for name in ("paper", "mixed"):
        for enc, gen in ((4, 4), (8, 4), (4, 8)):
            r = run(name, {"encoder": enc, "llm": LLM_DP, "generator": gen}, args.batches, args.seed)
            m = {k: statistics.mean(v) if v else float("nan") for k, v in r.items()}
            speed = statistics.mean(p / o for p, o in zip(r["span_post"], r["span_one"]))
            print(f"| {name} | {enc} / {gen} | {m['enc_one']:.3f}, {m['enc_post']:.3f}, {m['enc_lb']:.3f} | "
                  f"{m['gen_one']:.3f}, {m['gen_post']:.3f}, {m['gen_lb']:.3f} | {speed:.3f} | "
                  f"{100 * m['enc_moved']:.0f} %, {100 * m['gen_moved']:.0f} % | "
                  f"{m['ms_per_slot']:.1f} (max {max(r['ms_per_slot']):.0f}) |")


if __name__ == "__main__":
    main()

"""Benchmark the data-reordering algorithms and print Markdown tables.

    python bench/bench_reorder.py [--fixtures DIR] [--batches N] [--seed S]

Sources: MMC4 documents and LAION captions from the fixtures directory (default
``../shared/fixtures`` beside the repository; rows are skipped if it is absent), and the
synthetic LAION-400M statistics of :mod:`disttrain_ds.data.paper_stats`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.cost.model import LLAMA_PRESETS, SD21_UNET, VIT_HUGE_14, CostModel  # noqa: E402
from disttrain_ds.data.paper_stats import draw_sample_stats  # noqa: E402
from disttrain_ds.reorder.intra import (
    intra_microbatch_reorder,
    lpt_equal_count,
)
from disttrain_ds.reorder.microbatch_order import inter_microbatch_reorder, paper_inter_order
from disttrain_ds.samples import SampleStats  # noqa: E402
from disttrain_ds.schedule.simulate import makespan_1f1b, makespan_batch  # noqa: E402

TOKENS_PER_WORD = 1.3  # rough Llama-tokenizer ratio for English text
PATCH = 16
GEN_RES = 512
# ViT-H dims with 16-px patches, Llama3-7B, SD 2.1: per-sample training FLOPs.
COST = CostModel.from_dims(VIT_HUGE_14, LLAMA_PRESETS["llama3-7b"], SD21_UNET, enc_patch_size=PATCH)


def _image_patches(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    sides = rng.integers(224 // PATCH, 1024 // PATCH + 1, n)  # side in {224, 240, ..., 1024}
    return tuple(int(s * s) for s in sides)


def _doc_stats(words: int, n_images: int, rng: np.random.Generator) -> SampleStats:
    patches = _image_patches(rng, n_images)
    text = max(1, int(round(words * TOKENS_PER_WORD)))
    seq = text + sum(patches)
    return SampleStats(text, patches, seq, (seq,), gens=((n_images, GEN_RES),))


def load_sources(fixtures: Path, seed: int) -> dict[str, list[SampleStats] | str]:
    """Per-sample stats of every source; a string explains a skipped source."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[SampleStats] | str] = {}
    mmc4, laion = fixtures / "mmc4_sample.jsonl", fixtures / "laion_captions.jsonl"
    if mmc4.is_file():
        docs = [json.loads(line) for line in mmc4.read_text().splitlines() if line.strip()]
        out["MMC4 docs"] = [_doc_stats(sum(len(t.split()) for t in d["text_list"]),
                                       len(d["image_info"]), rng) for d in docs]
    else:
        out["MMC4 docs"] = f"skipped: {mmc4} not found"
    if laion.is_file():
        lines = [line for line in laion.read_text().splitlines() if line.strip()]
        caps = [json.loads(line)["caption"] for line in lines]
        out["LAION pairs"] = [_doc_stats(len(c.split()), 1, rng) for c in caps]
    else:
        out["LAION pairs"] = f"skipped: {laion} not found"
    out["paper stats (8K)"] = draw_sample_stats(4000, 8192, rng)
    return out


# ------------------------------------------------------------------ intra-microbatch


def _ratio(costs: np.ndarray, groups) -> float:
    loads = [costs[list(g)].sum() for g in groups]
    return max(loads) / (costs.sum() / len(groups))


def _milp_optimum(costs: np.ndarray, k: int) -> float:
    """Exact equal-count partition by MILP (x[i, r] binary, z = max load)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    costs = costs / costs.mean()  # FLOP-sized coefficients upset the solver's tolerances
    n, cap = len(costs), len(costs) // k
    nv = n * k + 1
    obj = np.zeros(nv)
    obj[-1] = 1.0
    rows, lo, hi = [], [], []
    for i in range(n):  # each sample on exactly one rank
        a = np.zeros(nv)
        a[i * k:(i + 1) * k] = 1
        rows.append(a), lo.append(1), hi.append(1)
    for r in range(k):  # equal counts, and load_r <= z
        a = np.zeros(nv)
        a[r:n * k:k] = 1
        rows.append(a), lo.append(cap), hi.append(cap)
        a = np.zeros(nv)
        a[r:n * k:k] = costs
        a[-1] = -1
        rows.append(a), lo.append(-np.inf), hi.append(0)
    lb = np.zeros(nv)
    lb[0] = 1  # symmetry: sample 0 on rank 0
    integrality = np.r_[np.ones(n * k), 0]
    res = milp(obj, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=integrality, bounds=Bounds(lb, np.r_[np.ones(n * k), np.inf]),
               options={"time_limit": 60})
    if res.x is None:
        raise RuntimeError(f"MILP failed: {res.message}")
    return float(res.x[-1]) / (costs.sum() / k)


def intra_table(sources, batches: int, seed: int) -> list[str]:
    import numberpartitioning as npart

    rows = ["| source | samples / ranks | input order | ours | LPT (equal counts) | "
            "greedy* | Karmarkar-Karp* | optimum (MILP) |", "|---|---|---|---|---|---|---|---|"]
    for name, data in sources.items():
        if isinstance(data, str):
            rows.append(f"| {name} | {data} | | | | | | |")
            continue
        costs_all = np.array([COST.train_cost(s) for s in data])
        for n, k in ((16, 4), (64, 8)):
            rng = np.random.default_rng(seed)
            acc: dict[str, list[float]] = {c: [] for c in ("in", "ours", "lpt", "gr", "kk", "opt")}
            for _ in range(batches):
                c = costs_all[rng.choice(len(costs_all), n, replace=False)]
                acc["in"].append(_ratio(c, np.arange(n).reshape(k, -1)))
                acc["ours"].append(_ratio(c, intra_microbatch_reorder(c, k)))
                acc["lpt"].append(_ratio(c, lpt_equal_count(c, k)))
                ints = [int(round(x / 1e9)) for x in c]  # the package expects integers (GFLOPs)
                for key, fn in (("gr", npart.greedy), ("kk", npart.karmarkar_karp)):
                    acc[key].append(_ratio(c, fn(ints, k, return_indices=True).partition))
                if n <= 16:
                    acc["opt"].append(_milp_optimum(c, k))
            cell = {key: f"{statistics.mean(v):.4f}" if v else "n/a" for key, v in acc.items()}
            rows.append(f"| {name} | {n} / {k} | {cell['in']} | {cell['ours']} | {cell['lpt']} | "
                        f"{cell['gr']} | {cell['kk']} | {cell['opt']} |")
    return rows


# ------------------------------------------------------------------ inter-microbatch


def stage_costs(samples: list[SampleStats], m: int, per_mb: int, llm_stages: int):
    """fwd/bwd ``[m, p]`` for encoder -> LLM stages -> generator.

    Each module's times are scaled so its mean per-microbatch time equals an LLM stage's, as
    a balanced orchestration would size it; only data heterogeneity is left."""
    costs = COST.costs(samples[:m * per_mb]).reshape(m, per_mb, 3).sum(axis=1)  # enc, llm, gen
    llm = costs[:, 1] / llm_stages
    enc = costs[:, 0] / max(costs[:, 0].mean(), 1e-30) * llm.mean()
    gen = costs[:, 2] / max(costs[:, 2].mean(), 1e-30) * llm.mean()
    fwd = np.column_stack([enc] + [llm] * llm_stages + [gen]) / llm.mean()
    return fwd, 2 * fwd


def inter_table(sources, batches: int, seed: int) -> list[str]:
    rows = ["| source | microbatches x stages | input order | paper | ours | ours (search only) | "
            "brute force |", "|---|---|---|---|---|---|---|"]
    for name, data in sources.items():
        if isinstance(data, str):
            rows.append(f"| {name} | {data} | | | | | |")
            continue
        for m, llm_stages in ((8, 2), (32, 4)):
            rng = np.random.default_rng(seed)
            acc: dict[str, list[float]] = {c: [] for c in ("in", "paper", "ours", "ls", "bf")}
            for _ in range(batches):
                picked = [data[i] for i in rng.choice(len(data), 2 * m, replace=False)]
                f, b = stage_costs(picked, m, 2, llm_stages)
                span = lambda o: makespan_1f1b(f[list(o)], b[list(o)])  # noqa: E731
                acc["in"].append(span(range(m)))
                acc["paper"].append(span(paper_inter_order(f, b)))
                acc["ours"].append(span(inter_microbatch_reorder(f, b, time_budget_s=1.0)))
                acc["ls"].append(span(inter_microbatch_reorder(f, b, exhaustive_max=0,
                                                               time_budget_s=1.0)))
                if m <= 8:
                    perms = np.array(list(itertools.permutations(range(m))))
                    acc["bf"].append(float(makespan_batch(f, b, perms).min()))
            cell = {key: f"{statistics.mean(v):.3f}" if v else "n/a" for key, v in acc.items()}
            rows.append(f"| {name} | {m} x {llm_stages + 2} | {cell['in']} | {cell['paper']} | "
                        f"{cell['ours']} | {cell['ls']} | {cell['bf']} |")
    return rows


def timing_table(seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    costs = np.array([COST.train_cost(s) for s in draw_sample_stats(1920, 8192, rng)])
    fwd = rng.lognormal(0, 0.5, (240, 10))
    bwd = 2 * fwd
    cases = [
        ("intra_microbatch_reorder, 1,920 samples / 16 ranks",
         lambda: intra_microbatch_reorder(costs, 16)),
        ("lpt_equal_count, 1,920 samples / 16 ranks", lambda: lpt_equal_count(costs, 16)),
        ("makespan_1f1b, 240 microbatches x 10 stages", lambda: makespan_1f1b(fwd, bwd)),
        ("paper_inter_order, 240 x 10", lambda: paper_inter_order(fwd, bwd)),
        ("inter_microbatch_reorder, 240 x 10 (time_budget_s=1.0)",
         lambda: inter_microbatch_reorder(fwd, bwd, time_budget_s=1.0)),
    ]
    rows = ["| call | ms per call |", "|---|---|"]
    for label, fn in cases:
        fn()  # warm caches
        reps = 3
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        rows.append(f"| {label} | {(time.perf_counter() - t) / reps * 1e3:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", type=Path, default=REPO.parent / "shared" / "fixtures",
                    help="directory holding mmc4_sample.jsonl and laion_captions.jsonl")
    ap.add_argument("--batches", type=int, default=5, help="random batches averaged per row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sources = load_sources(args.fixtures, args.seed)
    print("## DP balance: max / mean rank load (1.0 = perfect)\n")
    print("\n".join(intra_table(sources, args.batches, args.seed)))
    print("\n\\* numberpartitioning's greedy and Karmarkar-Karp do not enforce equal sample "
          "counts per rank; their rows solve an easier problem.\n")
    print("## 1F1B makespan (unit: mean LLM-stage forward time)\n")
    print("\n".join(inter_table(sources, args.batches, args.seed)))
    print("\n## Time per call\n")
    print("\n".join(timing_table(args.seed)))


if __name__ == "__main__":
    main()

"""Adaptive sequence-parallel groups (FlexSP) against one static SP degree and against no SP, by simulation.

    python bench/bench_flexsp.py [--steps N] [--batch B] [--gpus G] [--seed S]

The LLM is Llama-2 7B (the ``llama-7b`` preset) on G = 64 GPUs of 8 per node, a global batch of
512 sequences per step, sequences up to 192K tokens (FlexSP's setting: 64 GPUs, global batch 512,
192K). Per sequence (``reorder/sp_groups.py::SPCost``):

* compute: its training FLOPs (``cost/flops.py``: linear layers per token, causal attention per
  attended pair) at 400 TFLOP/s per GPU (about 40 % of an H100's bf16 peak), split over its group;
* all-to-alls: q, k, v and the output of every layer, forward and backward, in bf16, each GPU
  sending (p-1)/p of its slice, at the per-GPU all-to-all bandwidth FlexSP's authors measured by
  group size (Hetu-Galvatron, branch ``flexsp``, commit b4666892, ``flexsp_solver`` cost model:
  2: 119.5, 4: 104.1, 8: 96.5 GB/s inside a node; 16: 10.3, 32: 5.9, 64: 4.9 GB/s across nodes);
* memory: 34 h bytes of activations per token and layer (Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022, with the attention scores recomputed or fused
  away), 68 GB of each 80 GB GPU left for them (ZeRO-3 states of 7B over 64 GPUs and a CUDA / NCCL
  allowance beside): about 15.2K tokens per GPU.

Length distributions:

* ``long tail``: the histogram of 1,000,000 sampled Wikipedia sequence lengths that FlexSP's
  authors ship (Hetu-Galvatron ``flexsp`` branch, ``galvatron/datasets/wikipedia.txt``): share of
  sequences below 1K 78.79 %, 1-2K 10.85 %, 2-4K 5.96 %, 4-8K 2.80 %, 8-16K 1.12 %, 16-32K 0.35 %,
  32-64K 0.10 %, 64-128K 0.023 %, above 128K 0.005 %; lengths log-uniform inside a bucket (the
  first from 64), the last bucket up to 192K;
* ``uniform``: lengths uniform in [4K, 12K].

Each step's batch is cut, longest first, into microbatches of at most 90 % of the GPUs' token
capacity (FlexSP's sequence blaster orders the batch the same way); a microbatch that a strategy
cannot place in memory is halved until it fits. Strategies, on the same microbatches:

* ``no SP``: every sequence on one GPU (fails the memory check when one is longer than a GPU holds);
* ``static p``: G / p groups of p GPUs, sequences by LPT (one degree for the whole run, as a recipe
  sets ``parallel.llm.sp``). Two are compared: the fastest degree that fits every simulated step
  (the most favourable to static SP), and the fastest that holds the longest length the data may
  bring (192K on the long tail: what a recipe must set, since memory is checked before training);
* ``adaptive``: per microbatch, aligned power-of-two groups of mixed sizes (``adaptive_groups``).

Step time: the sum over its microbatches of the slowest group's time. Printed: total time per
strategy, the adaptive speedup over the best static degree, the group sizes adaptive chose, and its
planning time per microbatch on this CPU.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.reorder.sp_groups import SPCost, adaptive_groups, static_groups, transformer_cost  # noqa: E402

LLAMA_7B = dict(layers=32, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32, vocab=32000)
MAX_LEN = 192 * 1024
WIKIPEDIA = [  # (low, high, share of sequences): FlexSP's Wikipedia lengths (module docstring)
    (64, 1024, 78.79), (1024, 2048, 10.85), (2048, 4096, 5.96), (4096, 8192, 2.80), (8192, 16384, 1.12),
    (16384, 32768, 0.35), (32768, 65536, 0.10), (65536, 131072, 0.023), (131072, MAX_LEN, 0.005),
]
A2A_GBS = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
TFLOPS, GPU_GB_FOR_ACTIVATIONS, FILL = 400.0, 68.0, 0.9


def llama_cost() -> SPCost:
    per_token = 34 * LLAMA_7B["hidden"] * LLAMA_7B["layers"]  # bytes of activations per token (bf16, scores not kept)
    return transformer_cost(**LLAMA_7B, tflops=TFLOPS, bandwidth_gbs=A2A_GBS,
                            tokens_per_gpu=GPU_GB_FOR_ACTIVATIONS * 1e9 / per_token)


def draw(kind: str, n: int, rng: random.Random) -> list[int]:
    if kind == "uniform":
        return [rng.randint(4096, 12288) for _ in range(n)]
    lows, highs, shares = zip(*WIKIPEDIA)
    out = []
    for _ in range(n):
        b = rng.choices(range(len(shares)), weights=shares)[0]
        out.append(int(math.exp(rng.uniform(math.log(lows[b]), math.log(highs[b])))))
    return out


def microbatches(lengths: list[int], capacity: float) -> list[list[int]]:
    """Longest first, consecutive runs of at most ``capacity`` tokens."""
    out, cur, tokens = [], [], 0
    for x in sorted(lengths, reverse=True):
        if cur and tokens + x > capacity:
            out.append(cur)
            cur, tokens = [], 0
        cur.append(x)
        tokens += x
    return out + ([cur] if cur else [])


def run(mbs: list[list[int]], plan) -> tuple[float, list]:
    """Total ms of ``mbs`` under ``plan(lengths) -> SPPlan | None`` (a microbatch that does not fit
    is halved), and the plans made; inf if a single sequence fits nowhere."""
    total, plans, todo = 0.0, [], list(mbs)
    while todo:
        mb = todo.pop()
        got = plan(mb)
        if got is None:
            if len(mb) == 1:
                return math.inf, plans
            todo += [mb[: len(mb) // 2], mb[len(mb) // 2:]]
            continue
        total += got.makespan
        plans.append(got)
    return total, plans


def bench(kind: str, args, cost: SPCost) -> None:
    rng = random.Random(args.seed)
    steps = [microbatches(draw(kind, args.batch, rng), FILL * args.gpus * cost.tokens_per_gpu)
             for _ in range(args.steps)]
    longest = max(x for mbs in steps for mb in mbs for x in mb)
    sizes = [1 << k for k in range(args.gpus.bit_length()) if (1 << k) <= args.gpus]
    static = {}
    for p in sizes:
        static[p] = sum(run(mbs, lambda mb, p=p: static_groups(mb, args.gpus, p, cost))[0] for mbs in steps)
    times, chosen, made = [], Counter(), 0.0
    for mbs in steps:
        t0 = time.perf_counter()
        total, plans = run(mbs, lambda mb: adaptive_groups(mb, args.gpus, cost))
        made += time.perf_counter() - t0
        times.append(total)
        for plan in plans:
            chosen.update(g.size for g in plan.groups if g.seqs)
    adaptive = sum(times)
    n_mbs = sum(len(m) for m in steps)
    best_p = min(static, key=static.get)
    # A recipe's static degree must hold the longest sequence the data may bring (the memory check
    # runs before training), not only the longest this draw happened to hold.
    held = min(p for p in sizes if p * cost.tokens_per_gpu >= (MAX_LEN if kind == "long tail" else 12288))
    safe_p = min((p for p in sizes if p >= held), key=static.get)
    over = sum(x > cost.tokens_per_gpu for mbs in steps for mb in mbs for x in mb)
    print(f"\n{kind}: {args.steps} steps x {args.batch} sequences, {n_mbs} microbatches, longest {longest:,} tokens, "
          f"{cost.tokens_per_gpu:,.0f} tokens per GPU")
    print("  " + "  ".join(f"sp {p}: " + ("does not fit" if math.isinf(t) else f"{t / 1e3:.1f} s") for p, t in static.items()))
    no_sp = "does not fit" if math.isinf(static[1]) else f"{static[1] / 1e3:.1f} s"
    print(f"  no SP: {no_sp}" + (f" ({over} sequences longer than one GPU holds)" if over else ""))
    print(f"  adaptive: {adaptive / 1e3:.1f} s; groups used (size: count over microbatches): {dict(sorted(chosen.items()))}")
    print(f"  best static degree for these steps (sp {best_p}): {static[best_p] / 1e3:.1f} s, adaptive "
          f"{static[best_p] / adaptive:.2f}x faster")
    print(f"  best static degree that holds every length the data may hold (sp {safe_p}, sp >= {held}): "
          f"{static[safe_p] / 1e3:.1f} s, adaptive {static[safe_p] / adaptive:.2f}x faster")
    per_step = [run(m, lambda mb: static_groups(mb, args.gpus, best_p, cost))[0] for m in steps]
    print(f"  adaptive step time / best static step time: worst step {max(t / s for t, s in zip(times, per_step)):.3f}")
    print(f"  planning: {made / n_mbs * 1e3:.0f} ms per microbatch on this CPU (mean)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cost = llama_cost()
    print(f"Llama-2 7B, {args.gpus} GPUs, {TFLOPS:g} TFLOP/s per GPU, all-to-all GB/s per GPU by group size {A2A_GBS}")
    for kind in ("long tail", "uniform"):
        bench(kind, args, cost)


if __name__ == "__main__":
    main()

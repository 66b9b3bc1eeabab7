"""Solver time of the orchestration optimizer at the DistTrain paper's Table 2 scales.

Profiles are built from the paper's published figures (``disttrain_ds/paper/disttrain_paper.json``,
shipped with the package; ``--paper PATH`` reads another copy):

* forward times from Fig. 3 (one Llama3-70B stage at PP=10, TP=8, 8K sequence; whole ViT-Huge
  and whole SD 2.1, taken as TP=1 times), with backward = 2 x forward, so C = 3 x forward;
* the LLM's whole-module cost at TP=8 is 10 stages x the stage time; smaller backbones scale it by
  their FLOPs per sequence (same efficiency assumed);
* TP scaling: every doubling of TP runs at ``TP_EFFICIENCY`` (0.9), i.e.
  C(t) = C(1) / (t * 0.9 ** log2(t)), applied in both directions from the measured point;
* memory: LLM weights/gradients/Adam (2+2+12 bytes per parameter), LLM activations
  ~34 * seq * hidden bytes per layer per sequence (flash attention, no recomputation), encoder
  and generator parameters only (their activations are not published), 80 GiB per GPU;
* FLOPs: the LLM's 6 * params * tokens + 12 * layers * hidden * seq^2 only, so the printed MFU
  leaves the encoder's and generator's FLOPs out.

Run: ``python bench/bench_planner.py [--paper PATH] [--repeats 7]``;
``--write-example OUT.json --gpus N --batch B`` writes one profile instead (how the shipped
examples under ``disttrain_ds/planner/examples`` were made). ``--encoders E --generators G``
times a module graph of E parallel encoders and G parallel generators instead (copies of ViT-Huge
and SD 2.1, the i-th copy's costs x (1 + 0.25 i) so they differ; Megatron-LM's single chain
is n/a when E or G > 1). ``--draw N`` gives every module a draw of N per-sample costs
(``sample_cost_ms``: LAION-400M-like packed sequences priced by the cost model, as
``bench/paper_scale.py`` does), so the search prices stages by their expected slowest replica.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.cost.profile import Profile
from disttrain_ds.cost.profile_file import profile_from_dict, profile_to_dict, save_profile
from disttrain_ds.data.paper_stats import draw_sequence_layouts  # noqa: E402
from disttrain_ds.errors import ConfigError  # noqa: E402
from disttrain_ds.paper import (
    load_paper_figures,  # noqa: E402
    scale,  # noqa: E402
)
from disttrain_ds.planner.baselines import megatron_plan, ratio_plan  # noqa: E402
from disttrain_ds.planner.optimize import Plan, PlanError, plan, predicted_mfu, simulated_ms  # noqa: E402

TP_EFFICIENCY = 0.9
VOCAB = 128256  # Llama 3 tokenizer
MODELS = {"llama3-7b": "MLLM-9B", "llama3-13b": "MLLM-15B", "llama3-70b": "MLLM-72B"}


def _llm_shape(arch: dict) -> tuple[float, float]:
    """(parameters, FLOPs per sequence fwd+bwd) of a Llama backbone at 8K tokens."""
    h, f, layers = arch["hidden"], arch["ffn_hidden"], arch["layers"]
    kv = h // arch["heads"] * arch["kv_groups"]
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * f)
    return body + 2 * VOCAB * h, float(body)


def _tp_costs(cost: float, at_tp: int) -> dict[str, float]:
    c1 = cost * at_tp * TP_EFFICIENCY ** math.log2(at_tp)
    return {str(t): round(c1 / (t * TP_EFFICIENCY ** math.log2(t)), 3) for t in (1, 2, 4, 8)}


def _tp_sources(at_tp: int) -> dict[str, str]:
    """The paper's figure at ``at_tp`` is taken as given (not measured here); the rest are scaled."""
    return {str(t): "assumed" if t == at_tp else "interpolated" for t in (1, 2, 4, 8)}


def paper_profile(paper: dict, gpus: int, batch: int, model: str = "llama3-70b",
                  config: str = "8img_1024") -> Profile:
    """A profile at ``gpus``/``batch`` from the paper's per-module figures (see module doc)."""
    fwd = paper["forward_ms_profile_fig3"][config]
    seq = paper["sequence_length"]
    arch = paper["llm_backbones"][model]
    params, body = _llm_shape(arch)
    flops = 6 * body * seq + 12 * arch["layers"] * arch["hidden"] * seq**2
    _, body70 = _llm_shape(paper["llm_backbones"]["llama3-70b"])
    a70 = paper["llm_backbones"]["llama3-70b"]
    flops70 = 6 * body70 * seq + 12 * a70["layers"] * a70["hidden"] * seq**2
    llm_tp8 = 3 * fwd["llm_stage"] * 10 * flops / flops70
    return profile_from_dict({
        "description": f"{MODELS[model]} ({config}) built by bench/bench_planner.py from the "
                       f"DistTrain paper's Fig. 3; TP efficiency {TP_EFFICIENCY} per doubling",
        "gpus": gpus, "global_batch": batch, "microbatch": 1,
        "gpus_per_node": paper["hardware"]["gpus_per_node"], "gpu_memory_gb": 80,
        "peak_tflops": paper["hardware"]["bf16_peak_tflops"],
        "modules": {
            "encoder": {"layers": 32, "cost_ms": _tp_costs(3 * fwd["vit_huge"], 1),
                        "cost_source": _tp_sources(1),
                        "params": paper["encoder"]["params_b"] * 1e9},
            "llm": {"layers": arch["layers"], "cost_ms": _tp_costs(llm_tp8, 8),
                    "cost_source": _tp_sources(8),
                    "params": params, "flops_per_sample": flops,
                    "activation_bytes_per_sample": 34.0 * seq * arch["hidden"] * arch["layers"],
                    # Megatron-LM with sequence parallelism, as in the paper: all of it splits over TP
                    "activation_tp_sharded": 1.0},
            "generator": {"layers": 12, "cost_ms": _tp_costs(3 * fwd["sd21"], 1),
                          "cost_source": _tp_sources(1),
                          "params": paper["generator"]["params_b"] * 1e9},
        }})


def with_draw(profile: Profile, paper: dict, model: str, n: int, seed: int = 0) -> Profile:
    """``profile`` with ``n`` drawn packed sequences' per-sample costs in every module (FLOPs
    of ``model``'s modules scaled to each module's C(1)); ``n`` = 0 leaves it as it is."""
    if n == 0:
        return profile
    seq = paper["sequence_length"]
    spec = scale.model_specs(paper)[MODELS[model]]
    flops = scale.sample_costs(draw_sequence_layouts(n, seq, np.random.default_rng(seed)), spec,
                               seq).flops
    data = profile_to_dict(profile)
    names = ("encoder", "llm", "generator")
    for name, ms in zip(names, scale.sample_cost_draw(
            flops, [data["modules"][m]["cost_ms"]["1"] for m in names])):
        data["modules"][name]["sample_cost_ms"] = ms
    return profile_from_dict(data)


def with_graph(profile: Profile, encoders: int, generators: int) -> Profile:
    """``profile`` with its encoder and generator copied into ``encoders`` parallel encoders
    (``encoder0``, ...) and ``generators`` parallel generators; 1 and 1 leaves it as it is."""
    if (encoders, generators) == (1, 1):
        return profile
    data = profile_to_dict(profile)
    mods = data["modules"]
    out = {}
    for role, count in (("encoder", encoders), ("llm", 1), ("generator", generators)):
        for i in range(count):
            spec = {**mods[role], "role": role}
            spec["cost_ms"] = {t: c * (1 + 0.25 * i) for t, c in spec["cost_ms"].items()}
            if "sample_cost_ms" in spec:
                spec["sample_cost_ms"] = [c * (1 + 0.25 * i) for c in spec["sample_cost_ms"]]
            out[role if role == "llm" else f"{role}{i}"] = spec
    return profile_from_dict({**data, "modules": out})


def _layout(p: Plan) -> str:
    short = p.graph.names == ("encoder", "llm", "generator")
    return "  ".join(f"{n[:3] if short else n} {m.dp}x{m.tp}x{m.pp}" for n, m in p.modules.items())


def _time_ms(profile: Profile, repeats: int) -> tuple[float, float]:
    """Median wall-clock and median CPU milliseconds of ``plan(profile)``."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        plan(profile)
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paper", type=Path, default=None,
                    help="the paper's figures (JSON); default: the copy shipped in disttrain_ds/paper")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-70b")
    ap.add_argument("--config", default="8img_1024", help="Fig. 3 input configuration")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write-example", type=Path, help="write one profile to this path and exit")
    ap.add_argument("--gpus", type=int, default=1296)
    ap.add_argument("--batch", type=int, default=1920)
    ap.add_argument("--encoders", type=int, default=1, help="parallel encoders (module graph)")
    ap.add_argument("--generators", type=int, default=1, help="parallel generators (module graph)")
    ap.add_argument("--draw", type=int, default=0,
                    help="per-sample cost draw of this many sequences in every module (0: none)")
    args = ap.parse_args(argv)
    if args.draw < 0:
        ap.error("--draw must be >= 0")
    if args.encoders < 0 or args.generators < 0 or args.encoders + args.generators == 0:
        ap.error("--encoders and --generators must be >= 0 and not both 0")
    try:
        paper = load_paper_figures(args.paper)
    except ConfigError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.write_example:
        save_profile(paper_profile(paper, args.gpus, args.batch, args.model, args.config),
                     args.write_example)
        return 0
    tp, pp = (paper["megatron_baseline_layout"]["tp"],
              paper["megatron_baseline_layout"]["pp_llm"][MODELS[args.model]])
    draw = f"; per-sample draw of {args.draw} sequences" if args.draw else ""
    print(f"{MODELS[args.model]}, {args.config}{draw}; median of {args.repeats} runs; "
          f"Megatron-LM baseline at TP={tp}, PP={pp}; Python {sys.version.split()[0]}, "
          f"numpy {np.__version__}, {os.cpu_count()} CPUs")
    print(f"{'GPUs':>5} {'BS':>5} {'wall ms':>8} {'cpu ms':>7} {'paper ms':>9} {'speedup':>8}  "
          f"{'plan (dp x tp x pp)':<42} {'GPUs':>5} {'T s':>8} {'MFU':>5}  "
          f"{'ratio-based':>11} {'Megatron':>9}")
    for row in paper["solver_time_ms_table2"]:
        prof = with_graph(with_draw(paper_profile(paper, row["gpus"], row["global_batch"],
                                                  args.model, args.config),
                                    paper, args.model, args.draw),
                          args.encoders, args.generators)
        ours, cpu = _time_ms(prof, args.repeats)
        best = plan(prof)
        # With a draw the plan is chosen by its simulated iteration: every layout is timed so.
        timed = (lambda p: simulated_ms(prof, p)) if prof.has_draw else (lambda p: p.t_iter_ms)
        t_best = timed(best)
        others = []
        for make in (lambda: ratio_plan(prof), lambda: megatron_plan(prof, tp=tp, pp=pp)):
            try:
                others.append(f"{timed(make()) / t_best:.2f}x")
            except PlanError as exc:
                others.append("n/a" if "one pipeline chain" in str(exc) else "infeasible")
        mfu = predicted_mfu(prof, t_best, best.gpus) if prof.has_draw else best.mfu
        shown = f"{mfu * 100:.1f}" if mfu is not None else "n/a"
        print(f"{row['gpus']:>5} {row['global_batch']:>5} {ours:>8.1f} {cpu:>7.1f} {row['ms']:>9} "
              f"{row['ms'] / ours:>7.0f}x  {_layout(best):<42} {best.gpus:>5} "
              f"{t_best / 1e3:>8.2f} {shown:>5}  {others[0]:>11} {others[1]:>9}")
    print("speedup: paper ms / our wall ms; T: T_iter, or with --draw the simulated iteration the "
          "plan was chosen by; ratio-based and Megatron: their T over the plan's (higher is slower); "
          "MFU counts the LLM's FLOPs only")
    return 0


if __name__ == "__main__":
    sys.exit(main())

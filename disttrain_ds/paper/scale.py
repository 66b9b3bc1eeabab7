"""The DistTrain paper's three MLLMs at the paper's scale: profile, plan, simulate, score.

Pipeline of this module (every step a small pure function):

1. **Samples** (:func:`sample_costs`): 8K packed LAION-400M-like sequences from
   :mod:`disttrain_ds.data.paper_stats`, each priced by :class:`~disttrain_ds.cost.model.CostModel`
   in forward FLOPs per module (ViT-H/14 patches, the model's Llama backbone, one SD 2.1 U-Net
   step per image at the model's generation resolution).
2. **Profile** (:func:`build_profile`) from the paper's figures: Fig. 3 forward times, with
   backward = ``BACKWARD_FACTOR`` x forward. Encoder and generator times are interpolated linearly
   in images per sequence between Fig. 3's 8- and 16-image configurations at the model's
   resolution, evaluated at the samples' mean image count; they are taken as TP=1 times. The LLM's
   whole-module time at the reference TP is (stages x one Llama3-70B stage), scaled to smaller
   backbones by the ratio of their mean FLOPs on the same samples (equal efficiency assumed). TP
   scaling: ``TP_EFFICIENCY`` per doubling of TP, in both directions from the measured point.
3. **Plans** (:func:`paper_plans`): ours (``optimize.plan``), Megatron-LM's rigid layout at the
   paper's TP/PP, and two ratio-based splits (by profiled GPU-time, ``baselines.ratio_plan``, and
   by FLOPs), all on the same GPU budget.
4. **Simulation** (:mod:`disttrain_ds.planner.iteration_sim`, ``simulate_iteration``): per-sample
   module times are the cost model's FLOPs rescaled so each module's mean equals the plan's
   per-sample profile cost (so profile and variation agree); samples fill pipeline steps of
   D = DP_llm x M in order; within a step a module's replica r takes the r-th contiguous chunk of
   D / DP samples (DP fan-out/fan-in between modules of different DP); each replica's stages run
   its load / PP, and replicas wait for each other only where the runtime makes them (sample
   exchange at module boundaries, the all-reduce at the end); no communication time.
5. **Reordering** (``iteration_sim``): intra (``balance_steps``) balances each step's replicas with
   ``intra_microbatch_reorder``; inter reorders the steps with ``inter_microbatch_reorder``.
6. **Scores**: MFU = cost-model training FLOPs of the iteration / (GPUs x peak x time);
   throughput = sequences x sequence length / time.

The paper's models are the three-module graph; steps 4-6 take any plan's module graph: per-sample
time arrays have one column per module in the plan's data-flow order, and a graph with parallel
encoders or generators is simulated as a stage DAG (``simulate.makespan_dag``): encoders side by
side before the LLM, generators side by side after it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from disttrain_ds.cost.backward import BACKWARD_FACTOR
from disttrain_ds.cost.mfu import overall_mfu
from disttrain_ds.cost.model import LLAMA_PRESETS, SD21_UNET, VIT_HUGE_14, CostModel
from disttrain_ds.cost.profile import Profile
from disttrain_ds.cost.profile_file import profile_from_dict

# MODULES: the paper models' modules, the columns of SampleCosts.flops.
from disttrain_ds.cost.tp_scaling import tp_scaled
from disttrain_ds.data.paper_stats import Subsequence, layout_to_stats
from disttrain_ds.graph import MODULES  # noqa: F401
from disttrain_ds.planner.baselines import megatron_plan, ratio_plan

# Steps 4-5 live in planner/iteration_sim; their names stay reachable from here.
from disttrain_ds.planner.iteration_sim import (  # noqa: F401 (re-exported)
    VARIANTS,
    IterationSim,
    balance_step,
    balance_steps,
    group_stage_times,
    replica_groups,
    replica_max,
    sample_times,
    simulate_iteration,
    split_fwd_bwd,
    stage_times,
    straggler_factors,
)
from disttrain_ds.planner.optimize import Plan, plan
from disttrain_ds.samples import SampleStats

TP_EFFICIENCY = 0.9
"""Assumed speed-up efficiency per doubling of TP (the paper publishes one TP degree only)."""
ENCODER_PATCH = 14
"""Pixel side of a ViT-H/14 patch (the paper counts 16x16 tokens; images are re-cut to 14)."""
VOCAB = 128256
"""Llama 3 vocabulary (embedding and LM head parameters)."""
GENERATOR_LAYERS = 12
"""Pipeline-divisible blocks assumed for SD 2.1's U-Net (as ``bench/bench_planner.py``)."""
REFERENCE_BACKBONE = "llama3-70b"
"""Backbone whose pipeline stage Fig. 3 profiles."""


@dataclass(frozen=True)
class ModelSpec:
    """One MLLM of the paper's model table with its published experiment settings."""

    name: str
    """Model name, e.g. ``MLLM-9B``."""
    backbone: str
    """Llama backbone key of ``llm_backbones``, e.g. ``llama3-7b``."""
    resolution: int
    """Side in pixels of generated images (and of Fig. 3's configuration used)."""
    megatron_tp: int
    """TP degree of the paper's Megatron-LM baseline."""
    megatron_pp: int
    """LLM pipeline degree of the paper's Megatron-LM baseline."""
    scale_gpus: int
    """GPU budget at Fig. 15/16 scale: the larger of Megatron's and DistTrain's GPU counts."""
    ablation_gpus: int
    """GPU budget of the Fig. 17/18 ablations: the largest GPU count Fig. 17 reports."""
    ablation_batch: int
    """Global batch of the ablations (``microbench_global_batch``)."""


@dataclass(frozen=True)
class SampleCosts:
    """Per-sample cost-model figures of a sequence of packed samples."""

    stats: tuple[SampleStats, ...]
    """The samples, in draw order."""
    flops: np.ndarray
    """``[n, 3]`` forward FLOPs of each sample in (encoder, llm, generator)."""
    images: np.ndarray
    """``[n]`` input images per sample."""


@dataclass(frozen=True)
class PlanResult:
    """Simulated figures of one plan over one or more iterations, per reordering variant."""

    plan: Plan
    """The layout simulated."""
    t_ms: dict[str, float]
    """Variant -> mean simulated iteration time."""
    mfu: dict[str, float]
    """Variant -> MFU over all simulated iterations (0..1)."""
    tokens_per_s: dict[str, float]
    """Variant -> throughput in tokens per second over all simulated iterations."""


def model_specs(paper: Mapping) -> dict[str, ModelSpec]:
    """The paper's MLLMs by name, from ``mllms``, ``megatron_baseline_layout``, Fig. 15-17."""
    mega = paper["megatron_baseline_layout"]
    overall = {r["model"]: r for r in paper["overall_fig15_16"]}
    fig17 = {r["model"]: r for r in paper["orchestration_ablation_fig17"] if "model" in r}
    out = {}
    for name, text in paper["mllms"].items():
        backbone = re.match(r"\s*([\w.-]+)", text).group(1)
        res = int(re.search(r"generation (\d+)x\d+", text).group(1))
        out[name] = ModelSpec(
            name, backbone, res, int(mega["tp"]), int(mega["pp_llm"][name]),
            max(overall[name][k]["gpus"] for k in ("megatron", "disttrain")),
            max(v[0] for k, v in fig17[name].items() if k != "model"),
            int(mega["microbench_global_batch"][name]))
    return out


def sample_costs(layouts: Sequence[list[Subsequence]], spec: ModelSpec,
                 seq_len: int) -> SampleCosts:
    """Price packed layouts (``paper_stats.draw_sequence_layouts``) for ``spec``: every input
    image is also generated, at ``spec.resolution`` (Fig. 3's profile does the same)."""
    stats = tuple(layout_to_stats(lay, seq_len, ENCODER_PATCH, 1.0, spec.resolution)
                  for lay in layouts)
    flops = CostModel.paper_mllm(spec.backbone).costs(stats)
    return SampleCosts(stats, flops, np.array([len(s.image_patches) for s in stats]))


def fig3_forward_ms(paper: Mapping, resolution: int, images: float) -> dict[str, float]:
    """Fig. 3 forward times (``llm_stage``, ``vit_huge``, ``sd21``) at ``images`` per sequence:
    linear in the image count through the fewest- and most-image configurations measured at
    ``resolution`` (extrapolated outside them)."""
    pts = sorted((int(k.split("img_")[0]), v) for k, v in paper["forward_ms_profile_fig3"].items()
                 if re.fullmatch(rf"\d+img_{resolution}", k))
    if not pts:
        raise ValueError(f"Fig. 3 has no configuration at resolution {resolution}")
    (n0, a), (n1, b) = pts[0], pts[-1]
    w = 0.0 if n1 == n0 else (images - n0) / (n1 - n0)
    return {key: a[key] + w * (b[key] - a[key]) for key in a}


def tp_costs(cost: float, at_tp: int) -> dict[str, float]:
    """C(t) for t in 1, 2, 4, 8 from C(at_tp): C(t) = C(1) / (t * TP_EFFICIENCY ** log2 t)."""
    return {str(t): tp_scaled(cost, at_tp, t, TP_EFFICIENCY) for t in (1, 2, 4, 8)}


def _llm_params(arch: Mapping) -> float:
    h, f, layers = arch["hidden"], arch["ffn_hidden"], arch["layers"]
    kv = h // arch["heads"] * arch["kv_groups"]
    return layers * (2 * h * h + 2 * h * kv + 3 * h * f) + 2 * VOCAB * h  # + embedding, LM head


def sample_cost_draw(flops: np.ndarray, mean_ms: Sequence[float]) -> list[list[float]]:
    """Per-module ``sample_cost_ms`` draws: each column of ``flops`` (``[n, modules]``) rescaled
    so its mean is the module's mean cost ``mean_ms[j]`` (time proportional to FLOPs)."""
    f = np.asarray(flops, dtype=np.float64)
    return [(f[:, j] / f[:, j].mean() * c if f[:, j].mean() > 0 else np.zeros(len(f))).tolist()
            for j, c in enumerate(mean_ms)]


def build_profile(paper: Mapping, spec: ModelSpec, costs: SampleCosts, *, gpus: int,
                  global_batch: int, draw: SampleCosts | None = None) -> Profile:
    """The planner profile of ``spec`` (module doc, step 2). Memory as in
    ``bench/bench_planner.py``: LLM weights, gradients and Adam states, LLM activations of
    34 x seq x hidden bytes per layer per sequence, encoder and generator parameters only,
    the GPU memory named in ``hardware.gpu`` ("80GB"). ``flops_per_sample`` is the samples'
    mean training FLOPs of each module. ``draw``: samples whose FLOPs, rescaled to each
    module's C(1) (:func:`sample_cost_draw`), become the modules' ``sample_cost_ms``."""
    fwd = fig3_forward_ms(paper, spec.resolution, float(costs.images.mean()))
    ref = next(s for s in model_specs(paper).values() if s.backbone == REFERENCE_BACKBONE)
    ref_flops = CostModel.paper_mllm(REFERENCE_BACKBONE).costs(costs.stats)[:, 1].mean()
    train = 1.0 + BACKWARD_FACTOR
    llm = train * fwd["llm_stage"] * ref.megatron_pp * costs.flops[:, 1].mean() / ref_flops
    arch, seq = paper["llm_backbones"][spec.backbone], paper["sequence_length"]
    mean_flops = train * costs.flops.mean(axis=0)
    memory = float(re.search(r"(\d+)\s*GB", paper["hardware"]["gpu"]).group(1))
    enc, gen = train * fwd["vit_huge"], train * fwd["sd21"]  # Fig. 3: whole module, one GPU
    data = {
        "description": f"{spec.name} from the DistTrain paper's Fig. 3 by disttrain_ds.planner."
                       f"scale; TP efficiency {TP_EFFICIENCY} per doubling",
        "gpus": gpus, "global_batch": global_batch, "microbatch": 1,
        "gpus_per_node": paper["hardware"]["gpus_per_node"], "gpu_memory_gb": memory,
        "peak_tflops": paper["hardware"]["bf16_peak_tflops"],
        "modules": {
            "encoder": {"layers": VIT_HUGE_14.layers, "cost_ms": tp_costs(enc, 1),
                        "params": paper["encoder"]["params_b"] * 1e9,
                        "flops_per_sample": float(mean_flops[0])},
            "llm": {"layers": arch["layers"], "cost_ms": tp_costs(llm, ref.megatron_tp),
                    "params": _llm_params(arch), "flops_per_sample": float(mean_flops[1]),
                    "activation_bytes_per_sample": 34.0 * seq * arch["hidden"] * arch["layers"],
                    # Megatron-LM with sequence parallelism, as in the paper: all of it splits over TP
                    "activation_tp_sharded": 1.0},
            "generator": {"layers": GENERATOR_LAYERS, "cost_ms": tp_costs(gen, 1),
                          "params": paper["generator"]["params_b"] * 1e9,
                          "flops_per_sample": float(mean_flops[2])},
        }}
    if draw is not None:
        mods = data["modules"]
        for name, ms in zip(MODULES, sample_cost_draw(draw.flops, [mods[n]["cost_ms"]["1"]
                                                                   for n in MODULES])):
            mods[name]["sample_cost_ms"] = ms
        data["description"] += f"; sample_cost_ms: {len(draw.flops)} drawn samples' FLOPs"
    return profile_from_dict(data)


def flop_split(profile: Profile) -> dict[str, int]:
    """GPUs per module in proportion to training FLOPs per sample (``flops_per_sample``),
    rounded as ``baselines.ratio_split`` does (floors, leftovers to the largest remainders)."""
    names = profile.graph.names
    w = {n: profile.modules[n].flops_per_sample or 0.0 for n in names}
    exact = {n: profile.gpus * w[n] / sum(w.values()) for n in names}
    share = {n: math.floor(exact[n]) for n in names}
    left = profile.gpus - sum(share.values())
    for n in sorted(names, key=lambda n: share[n] - exact[n])[:left]:
        share[n] += 1
    return {n: max(1, share[n]) for n in names}


def paper_plans(profile: Profile, spec: ModelSpec) -> dict[str, Plan]:
    """``ours`` (exact optimum), ``megatron`` (paper's TP/PP), ``ratio`` (GPUs split by profiled
    GPU-time, ``baselines.ratio_plan``) and ``flops`` (split by FLOPs, :func:`flop_split`), each
    the best layout inside its split. The paper's cost model has no node placement, so none of
    them is held to the planner's node rule (``plan(aligned=False)``)."""
    return {"ours": plan(profile, aligned=False),
            "megatron": megatron_plan(profile, tp=spec.megatron_tp, pp=spec.megatron_pp),
            "ratio": ratio_plan(profile, aligned=False),
            "flops": replace(plan(profile, gpu_caps=flop_split(profile), aligned=False),
                             layout="flop-ratio")}


def module_efficiency(profile: Profile, name: str, tp: int) -> float:
    """Share of peak a module's profile implies at TP ``tp``: its mean training FLOPs per
    sample over (tp GPUs x C(tp) x peak). Above 1 means the profile is faster than the FLOPs
    allow, i.e. the profiled inputs were lighter than the simulated ones."""
    spec = profile.modules[name]
    return (spec.flops_per_sample or 0.0) / (
        tp * spec.cost_ms[tp] * 1e-3 * (profile.peak_tflops or math.inf) * 1e12)


def full_attention_llm_flops(backbone: str, seq_len: int) -> float:
    """Training FLOPs of one sequence in the LLM counted as Megatron-LM's formula does: full
    (non-causal) attention over the whole packed sequence, documents ignored."""
    cm = CostModel.from_dims(VIT_HUGE_14, LLAMA_PRESETS[backbone], SD21_UNET, causal=False)
    return (1.0 + BACKWARD_FACTOR) * cm.llm_cost(SampleStats(0, (), seq_len))


def mfu(flops: float, gpus: int, t_ms: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: ``flops`` done in ``t_ms`` over ``gpus`` GPUs' peak."""
    return overall_mfu(flops, gpus, peak_tflops, t_ms * 1e-3)


def tokens_per_s(sequences: int, seq_len: int, t_ms: float) -> float:
    """Throughput counting every position of the packed sequences (padding included)."""
    return sequences * seq_len / (t_ms * 1e-3)


def evaluate_plan(plan_: Plan, profile: Profile, costs: SampleCosts, *, iterations: int,
                  seq_len: int, variants: Sequence[str] = tuple(VARIANTS),
                  budget_s: float = 0.5, lock_step: bool = False) -> PlanResult:
    """Simulate ``iterations`` consecutive global batches of ``costs`` under ``plan_`` for each
    reordering variant (``lock_step``: the coarser replica model, ``iteration_sim``); MFU and
    throughput aggregate all iterations (total work / total time)."""
    bs = profile.global_batch
    if profile.peak_tflops is None:
        raise ValueError("the profile needs peak_tflops for MFU")
    if len(costs.flops) < bs * iterations:
        raise ValueError(f"need {bs * iterations} samples, got {len(costs.flops)}")
    used = costs.flops[:bs * iterations]
    times = sample_times(used, plan_)
    work = float(used.sum()) * (1.0 + BACKWARD_FACTOR)
    t, m, tok = {}, {}, {}
    for v in variants:
        intra, inter = VARIANTS[v]
        total = sum(simulate_iteration(times[i * bs:(i + 1) * bs], plan_, intra=intra,
                                       inter=inter, budget_s=budget_s, seed=i,
                                       lock_step=lock_step).makespan_ms
                    for i in range(iterations))
        t[v] = total / iterations
        m[v] = mfu(work, plan_.gpus, total, profile.peak_tflops)
        tok[v] = tokens_per_s(bs * iterations, seq_len, total)
    return PlanResult(plan_, t, m, tok)

"""The two orchestration baselines of the DistTrain paper, evaluated with the same cost model.

* ``megatron_plan``: Megatron-LM's rigid layout. The encoder is one extra pipeline stage in front
  of the LLM's PP stages and the generator one extra stage behind them, each replicated across the
  TP group (every GPU of that stage runs the whole module, so it runs at TP=1 speed). All modules
  share the LLM's DP degree, so one replica takes TP * (PP + 2) GPUs.
* ``ratio_plan``: GPUs split across modules in proportion to their per-sample cost, then the best
  (dp, tp, pp) of each module inside its share.

Both return a ``Plan`` whose ``t_iter_ms`` comes from ``optimize.combine``, so they are directly
comparable with ``optimize.plan``; neither can beat it (see ``docs/planner.md``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from disttrain_ds.planner.optimize import (Degrees, ModulePlan, Plan, PlanError, combine,
                                           memory_per_gpu, plan, predicted_mfu)
from disttrain_ds.planner.profile import GIB, MODULES, Profile


def megatron_plan(profile: Profile, *, tp: int, pp: int) -> Plan:
    """Megatron-LM's layout at LLM degrees ``tp``/``pp`` with the largest DP that fits.

    With w_llm = M * C_llm(tp), w_enc = M * C_enc(1), w_gen = M * C_gen(1) and K = BS / (DP * M),
    the pipeline of PP + 2 stages takes

        T_iter = (w_llm + (w_enc + w_gen)) + max(w_llm / PP, w_enc, w_gen) * (K - 1)

    i.e. the disaggregated formula with DP_enc = DP_gen = DP and PP_enc = PP_gen = 1, on
    DP * TP * (PP + 2) GPUs. Memory follows 1F1B on PP + 2 stages: the encoder stage holds
    min(PP + 2, K) microbatches, the first LLM stage min(PP + 1, K), the generator stage one.
    """
    llm, m, bs = profile.modules["llm"], profile.microbatch, profile.global_batch
    if tp not in llm.tp_degrees(profile.gpus_per_node):
        raise PlanError(f"megatron layout: llm has no cost_ms entry for tp={tp} "
                        f"within gpus_per_node {profile.gpus_per_node}")
    if llm.layers % pp:
        raise PlanError(f"megatron layout: pp={pp} does not divide the llm's {llm.layers} layers")
    for n in ("encoder", "generator"):
        if 1 not in profile.modules[n].cost_ms:
            raise PlanError(f"megatron layout: {n} is replicated across the TP group and needs "
                            f"cost_ms for tp=1")
    per_replica = tp * (pp + 2)
    dps = [dp for dp in range(profile.gpus // per_replica, 0, -1) if bs % (dp * m) == 0]
    if not dps:
        raise PlanError(f"megatron layout (tp={tp}, pp={pp}) needs {per_replica} GPUs per "
                        f"replica and a DP dividing global_batch {bs}; profile has "
                        f"{profile.gpus} GPUs")
    dp = dps[0]
    k = bs // (dp * m)
    w = {"llm": m * llm.cost_ms[tp], "encoder": m * profile.modules["encoder"].cost_ms[1],
         "generator": m * profile.modules["generator"].cost_ms[1]}
    stage = {"llm": w["llm"] / pp, "encoder": w["encoder"], "generator": w["generator"]}
    it = combine(w["llm"], w["encoder"], w["generator"], stage["llm"], stage["encoder"],
                 stage["generator"], k)
    shard = {"llm": Degrees(dp, tp, pp), "encoder": Degrees(dp, 1, 1),
             "generator": Degrees(dp, 1, 1)}
    in_flight = {"encoder": min(pp + 2, k), "llm": min(pp + 1, k), "generator": 1}
    mods = {}
    for n in MODULES:
        spec = profile.modules[n]
        mem = memory_per_gpu(spec, shard[n], samples_per_microbatch=m, in_flight=in_flight[n])
        limit = profile.memory_limit_bytes
        if limit is not None and mem > limit:
            raise PlanError(f"megatron layout (tp={tp}, pp={pp}, dp={dp}): {n} needs "
                            f"{mem / GIB:.1f} GiB per GPU, more than {profile.gpu_memory_gb:g}")
        gpus = dp * tp * (pp if n == "llm" else 1)
        mods[n] = ModulePlan(gpus, dp, tp, pp if n == "llm" else 1, m, w[n], stage[n],
                             mem / GIB if spec.has_memory_figures else None)
    total = dp * per_replica
    return Plan(**mods, microbatches=k, t_warmup_ms=it.warmup_ms, t_steady_ms=it.steady_ms,
                t_iter_ms=it.total_ms, mfu=predicted_mfu(profile, it.total_ms, total),
                layout="megatron")


def ratio_split(profile: Profile) -> dict[str, int]:
    """GPUs per module in proportion to GPU-time per sample at the smallest measured TP degree
    (C(1) when given, else t * C(t)); floors, with the leftover GPUs going to the largest
    remainders, and at least one GPU each."""
    weight = {}
    for n in MODULES:
        spec = profile.modules[n]
        t = min(spec.tp_degrees(profile.gpus_per_node) or spec.cost_ms)
        weight[n] = t * spec.cost_ms[t]
    total = sum(weight.values())
    exact = {n: profile.gpus * weight[n] / total for n in MODULES}
    share = {n: math.floor(exact[n]) for n in MODULES}
    by_remainder = sorted(MODULES, key=lambda n: (share[n] - exact[n], MODULES.index(n)))
    for n in by_remainder[: profile.gpus - sum(share.values())]:
        share[n] += 1
    return {n: max(1, share[n]) for n in MODULES}


def ratio_plan(profile: Profile) -> Plan:
    """The ratio-based baseline: the minimum-T_iter layout with every module inside its
    ``ratio_split`` share (the best integer degrees near the proportional split)."""
    return replace(plan(profile, gpu_caps=ratio_split(profile)), layout="ratio-based")

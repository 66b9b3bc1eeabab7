"""The two orchestration baselines of the DistTrain paper, evaluated with the same cost model.

* ``megatron_plan``: Megatron-LM's rigid layout. The encoder is one extra pipeline stage in front
  of the LLM's PP stages and the generator one extra stage behind them, each replicated across the
  TP group (every GPU of that stage runs the whole module, so it runs at TP=1 speed). All modules
  share the LLM's DP degree, so one replica takes TP * (PP + 2) GPUs. A graph without an encoder
  or without a generator drops that stage; graphs with parallel encoders or generators have no
  single Megatron-LM chain and are refused.
* ``ratio_plan``: GPUs split across all modules of the graph in proportion to their per-sample
  cost, then the best (dp, tp, pp) of each module inside its share.

Both return a ``Plan`` whose times come from ``objective.t_iter`` with the profile's straggler
factors (per-sample draws included), so a layout gets the same predicted time however it was
found and the baselines are directly comparable with ``optimize.plan``; neither can beat it
(see ``docs/planner.md``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from disttrain_ds.cost.profile import GIB, Profile
from disttrain_ds.planner.objective import Degrees, memory_per_gpu, module_terms, straggler_table, t_iter
from disttrain_ds.planner.optimize import ModulePlan, Plan, PlanError, plan, predicted_mfu
from disttrain_ds.planner.pipeline import predict


def megatron_plan(profile: Profile, *, tp: int, pp: int) -> Plan:
    """Megatron-LM's layout at LLM degrees ``tp``/``pp`` with the largest DP that fits.

    With w_llm = M * C_llm(tp), w_enc = M * C_enc(1), w_gen = M * C_gen(1) and K = BS / (DP * M),
    the pipeline of PP + 2 stages takes

        T_iter = (w_llm + (w_enc + w_gen)) + max(w_llm / PP, w_enc, w_gen) * (K - 1)

    i.e. the disaggregated formula with DP_enc = DP_gen = DP and PP_enc = PP_gen = 1, on
    DP * TP * (PP + 2) GPUs; it is priced by ``objective.t_iter`` on that layout (straggler
    factors included when the profile has per-sample draws). Memory follows 1F1B on PP + 2 stages: the encoder stage holds
    min(PP + 2, K) microbatches, the first LLM stage min(PP + 1, K), the generator stage one.
    Without an encoder (generator) the chain is one stage shorter and that term is 0.
    """
    graph = profile.graph
    if len(graph.encoders) > 1 or len(graph.generators) > 1:
        raise PlanError(f"megatron layout: one pipeline chain holds at most one encoder and one "
                        f"generator, this graph has {', '.join(graph.names)}")
    lname, m, bs = graph.llm, profile.microbatch, profile.global_batch
    llm = profile.modules[lname]
    if tp not in llm.tp_degrees(profile.gpus_per_node):
        raise PlanError(f"megatron layout: {lname} has no cost_ms entry for tp={tp} "
                        f"within gpus_per_node {profile.gpus_per_node}")
    if llm.layers % pp:
        raise PlanError(f"megatron layout: pp={pp} does not divide the {lname}'s "
                        f"{llm.layers} layers")
    extra = graph.encoders + graph.generators
    for n in extra:
        if 1 not in profile.modules[n].cost_ms:
            raise PlanError(f"megatron layout: {n} is replicated across the TP group and needs "
                            f"cost_ms for tp=1")
    stages = pp + len(extra)
    per_replica = tp * stages
    dps = [dp for dp in range(profile.gpus // per_replica, 0, -1) if bs % (dp * m) == 0]
    if not dps:
        raise PlanError(f"megatron layout (tp={tp}, pp={pp}) needs {per_replica} GPUs per "
                        f"replica and a DP dividing global_batch {bs}; profile has "
                        f"{profile.gpus} GPUs")
    dp = dps[0]
    k = bs // (dp * m)
    # The same layout as a disaggregated one: every module at DP, the extra stages at TP=1 speed.
    layout = {n: Degrees(dp, tp, pp) if n == lname else Degrees(dp, 1, 1) for n in graph.names}
    table = straggler_table(profile)
    it = t_iter(profile, layout, table)
    terms = {n: module_terms(profile, n, layout[n], m, table) for n in graph.names}
    first = {n: i for i, n in enumerate(graph.names)}  # stage index: encoder, LLM stages, generator
    first.update({n: len(graph.encoders) + pp for n in graph.generators})
    mods = {}
    for n in graph.names:
        spec, own_pp = profile.modules[n], pp if n == lname else 1
        deg = Degrees(dp, tp if n == lname else 1, own_pp)
        mem = memory_per_gpu(spec, deg, samples_per_microbatch=m, stages_to_end=stages - first[n],
                             microbatches=k)
        limit = profile.memory_limit_bytes
        if limit is not None and mem > limit:
            raise PlanError(f"megatron layout (tp={tp}, pp={pp}, dp={dp}): {n} needs "
                            f"{mem / GIB:.1f} GiB per GPU, more than {profile.gpu_memory_gb:g}")
        h = 1.0 if table is None else table.factor(n, dp, m)
        g = 1.0 if table is None else table.factor(n, dp, m, own_pp)
        mods[n] = ModulePlan(dp * tp * own_pp, dp, tp, own_pp, m, *terms[n],
                             mem / GIB if spec.has_memory_figures else None, h,
                             cost_source=spec.source(tp if n == lname else 1), pace=g)
    total = dp * per_replica
    pred = predict(graph, {n: layout[n].pp for n in graph.names}, it.total_ms,
                   {n: mods[n].stage_ms for n in graph.names}, k)
    return Plan(mods, graph, microbatches=k, t_warmup_ms=it.warmup_ms, t_steady_ms=it.steady_ms,
                t_iter_ms=it.total_ms, mfu=predicted_mfu(profile, pred, total),
                layout="megatron", t_pred_ms=pred)


def ratio_split(profile: Profile) -> dict[str, int]:
    """GPUs per module in proportion to GPU-time per sample at the smallest measured TP degree
    (C(1) when given, else t * C(t)); floors, with the leftover GPUs going to the largest
    remainders (earlier modules first on ties), and at least one GPU each."""
    names = profile.graph.names
    weight = {}
    for n in names:
        spec = profile.modules[n]
        t = min(spec.tp_degrees(profile.gpus_per_node) or spec.cost_ms)
        weight[n] = t * spec.cost_ms[t]
    total = sum(weight.values())
    exact = {n: profile.gpus * weight[n] / total for n in names}
    share = {n: math.floor(exact[n]) for n in names}
    by_remainder = sorted(names, key=lambda n: (share[n] - exact[n], names.index(n)))
    for n in by_remainder[: profile.gpus - sum(share.values())]:
        share[n] += 1
    return {n: max(1, share[n]) for n in names}


def ratio_plan(profile: Profile, aligned: bool = True) -> Plan:
    """The ratio-based baseline: the minimum-T_iter layout with every module inside its
    ``ratio_split`` share (the best integer degrees near the proportional split)."""
    return replace(plan(profile, gpu_caps=ratio_split(profile), aligned=aligned), layout="ratio-based")

"""Exact orchestration optimizer: per-module (DP, TP, PP) minimising one iteration's time.

The objective (:mod:`disttrain_ds.planner.objective`), over a module graph of encoders -> LLM ->
generators, with D = DP_llm * M samples per pipeline step and K = BS / D steps per iteration:

    T_iter = (w_llm + (max_enc w_e + max_gen w_g)) + max_i s_i * (K - 1)

where module i at (dp, tp, pp) has warm-up term w_i = m_i * C_i(tp), m_i = D / dp samples per
step (M for the LLM), and stage time s_i = w_i / pp. For the three-module graph this is
``(w_llm + (w_enc + w_gen)) + max(s_llm, s_enc, s_gen) * (K - 1)``. ``plan`` finds its exact
minimum with :func:`disttrain_ds.planner.search.search` (complexity in that module's docstring);
``exhaustive_plan`` is the brute force it must agree with bit for bit, tie-break included.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Mapping

import numpy as np

from disttrain_ds.cost.mfu import overall_mfu
from disttrain_ds.cost.profile import AUTO_SP, GIB, Profile
from disttrain_ds.planner.climb import climb, layout_bound
from disttrain_ds.planner.hetero import StragglerTable
from disttrain_ds.planner.iteration_sim import sample_times, simulate_iteration, simulate_scaled
from disttrain_ds.planner.neighbours import Feasible
from disttrain_ds.planner.objective import (  # noqa: F401
    Degrees,
    IterTime,
    combine,
    divisors,
    layout_key,
    layout_memory,
    memory_per_gpu,
    module_terms,
    samples_per_step,
    straggler_table,
    t_iter,
)
from disttrain_ds.planner.pipeline import predict
from disttrain_ds.planner.placement import first_ranks, tp_aligned  # noqa: F401 (re-exported)
from disttrain_ds.planner.plan import ModulePlan, Plan, PlanError  # noqa: F401 (re-exported)
from disttrain_ds.planner.refine import StepEstimate, refine
from disttrain_ds.planner.search import batch_splits, options, search
from disttrain_ds.planner.search import finalists as best_layouts
from disttrain_ds.planner.sim_bound import SimBound, unit_times
from disttrain_ds.planner.sp_auto import draw_cost


def predicted_mfu(profile: Profile, t_iter_ms: float, gpus: int) -> float | None:
    """Model FLOPs of one iteration over the peak of ``gpus`` GPUs for ``t_iter_ms``; modules
    without ``flops_per_sample`` count as zero FLOPs. None without any FLOPs or a peak."""
    flops = [s.flops_per_sample for s in profile.modules.values() if s.flops_per_sample is not None]
    if not flops or profile.peak_tflops is None:
        return None
    return overall_mfu(sum(flops) * profile.global_batch, gpus, profile.peak_tflops, t_iter_ms * 1e-3)


def build_plan(profile: Profile, layout: Mapping[str, Degrees],
               layout_name: str = "disaggregated", table: StragglerTable | None = None,
               predicted: bool = True) -> Plan:
    """Evaluate a disaggregated ``layout`` into a Plan (times, memory, MFU); no search.
    ``table``: the profile's straggler factors, made here when None and the profile has draws;
    ``predicted=False`` skips the schedule's prediction (``t_pred_ms`` is then the closed form's
    time and ``mfu`` None: candidates about to be simulated, not plans to return)."""
    graph = profile.graph
    d = layout[graph.llm].dp * profile.microbatch
    k = profile.global_batch // d
    table = straggler_table(profile) if table is None else table
    it = t_iter(profile, layout, table)
    mods, memory = {}, layout_memory(profile, layout)
    for n in graph.names:
        deg, spec = layout[n], profile.modules[n]
        m = samples_per_step(profile, n, d, deg.dp)
        warm, stage = module_terms(profile, n, deg, m, table)
        mem = memory[n]
        h = 1.0 if table is None else table.factor(n, deg.dp, m)
        g = 1.0 if table is None else table.factor(n, deg.dp, m, deg.pp)
        if table is not None and deg.sp == AUTO_SP:
            h, g = (table.auto_factor(n, deg.dp, m, pp, deg.tp) for pp in (1, deg.pp))
        mods[n] = ModulePlan(deg.gpus, deg.dp, deg.tp, deg.pp, m, warm,
                             stage, mem / GIB if spec.has_memory_figures else None, h,
                             spec.source(deg.tp), g, deg.sp)
    gpus = sum(p.gpus for p in mods.values())
    pred = predict(graph, {n: layout[n].pp for n in graph.names}, it.total_ms,
                   {n: mods[n].stage_ms for n in graph.names}, k) if predicted else it.total_ms
    return Plan(mods, graph, microbatches=k, t_warmup_ms=it.warmup_ms, t_steady_ms=it.steady_ms,
                t_iter_ms=it.total_ms, mfu=predicted_mfu(profile, pred, gpus) if predicted else None,
                layout=layout_name, t_pred_ms=pred)


FINALISTS = 4
"""With per-sample draws: how many layouts (the best of as many samples-per-step splits) the
search hands to the simulator from each of two rankings (the closed form with the draw's
straggler factors, and from mean costs); the fastest simulated one is kept."""
REFINED = 8
"""With per-sample draws: how many layouts of lowest step estimate (``refine.py``) are simulated
beside the finalists."""
SIM_SAMPLES = 1024
"""Samples resampled from the draw for each finalist's simulated iterations (at least one global
batch; a 72B plan at 1,296 GPUs simulates one batch of 1,920 in about 0.03 s)."""
SIM_SEED = 0
"""Seed of the resampled global batches (the same batches for every finalist)."""


def plan(profile: Profile, *, gpu_caps: Mapping[str, int] | None = None,
         aligned: bool = True, finalists: int | None = None) -> Plan:
    """The exact minimum-T_iter layout; ``gpu_caps`` optionally bounds each module's GPUs.
    ``aligned`` (the default; what ``disttrain-plan`` writes): every module's first rank is a
    multiple of its TP degree, so no TP group spans nodes; False drops that rule (the paper's
    model, for comparisons only). With per-sample draws the ``finalists`` (default ``FINALISTS``)
    best layouts of the closed form, as many from mean costs, and the ``REFINED`` layouts of
    lowest step estimate found near them (``refine.py``) are simulated on global batches
    resampled from the draw (``simulated_ms``: each step waits for its slowest replica and
    module, which the closed form prices only in expectation), in order of a lower bound on
    their simulated time (``sim_bound``; one whose bound reaches the best time found is not
    simulated); from the fastest, a descent on the simulated time over one-module changes
    (``climb.py``) returns the layout it ends at; 1: the closed form's best. Raises PlanError with
    the binding constraint when nothing is feasible."""
    caps = {n: profile.gpus if gpu_caps is None else min(gpu_caps[n], profile.gpus)
            for n in profile.graph.names}
    table = straggler_table(profile)
    count = (FINALISTS if table is not None else 1) if finalists is None else finalists
    memo: dict = {}  # every search below lists the same layouts
    found = best_layouts(profile, caps, table, aligned, count, memo)
    if not found:
        if aligned and search(profile, caps, aligned=False) is not None:
            raise PlanError(_unaligned_only(profile, caps))
        raise PlanError(_diagnose(profile, caps))
    if count > 1 and any(d.sp == AUTO_SP for layout in found for d in layout.values()):
        # The closed form prices adaptive groups and SP 1 alike at each stage's slowest replica,
        # but SP 1's replicas drift apart where groups keep them in step: the best layouts
        # without adaptive groups are simulated beside them.
        found += [x for x in best_layouts(without_auto(profile), caps, table, aligned, count) if x not in found]
    if count > 1 and table is not None:
        # The closed form over-counts warm-up where there are few steps; mean costs rank layouts
        # by another error, and their best layouts are often the faster ones there.
        found += [x for x in best_layouts(profile, caps, None, aligned, count, memo) if x not in found]
    if count == 1 or not profile.has_draw:
        return build_plan(profile, found[0], table=table)
    # A step waits for its slowest stage: layouts near the finalists ranked by that on sampled
    # steps (``refine.py``) are simulated beside them.
    unit = sim_unit_times(profile)
    found += [x for x in refine(profile, found, StepEstimate(profile, unit), memo, REFINED, caps, aligned)
              if x not in found]
    if len(found) == 1:
        return build_plan(profile, found[0], table=table)
    chosen = _fastest_simulated(profile, found, unit, table)
    if any(m.sp == AUTO_SP for m in chosen.modules.values()):
        return chosen  # adaptive groups: the descent's sweep does not regroup replicas
    # What the simulation couples and the estimates miss: a descent on it from the fastest one.
    build = lambda x: build_plan(profile, x, table=table, predicted=False)  # noqa: E731
    layout, _ = climb(profile, chosen.degrees(), unit, Feasible(profile, memo, caps, aligned), build)
    if layout != chosen.degrees() and (t := simulated_ms(profile, build(layout))) < chosen.t_sim_ms:
        return replace(build_plan(profile, layout, table=table), t_sim_ms=t, finalists=chosen.finalists)
    return chosen


def _fastest_simulated(profile: Profile, layouts: list[dict[str, Degrees]], unit: np.ndarray,
                       table: StragglerTable | None) -> Plan:
    """The plan of ``layouts`` with the shortest ``simulated_ms``, simulating them in order of
    ``sim_bound``'s lower bound on ``unit`` (the simulated batches' unit times) and none whose
    bound reaches the best time found (ties: the order of ``layouts``)."""
    plans = [build_plan(profile, layout, table=table, predicted=False) for layout in layouts]
    bound = SimBound(profile.graph, unit, ordered=True)
    lbs = [layout_bound(profile, bound, x) for x in layouts]
    best: tuple[float, int] | None = None
    for i in sorted(range(len(plans)), key=lambda j: (lbs[j], j)):
        if best is not None and lbs[i] > best[0] * (1 + 1e-9):  # rounding: a tight bound may equal the time
            break
        t = simulated_ms(profile, plans[i])
        if best is None or (t, i) < best:
            best = (t, i)
    assert best is not None
    return replace(build_plan(profile, layouts[best[1]], table=table), t_sim_ms=best[0], finalists=len(plans))


def _draw(profile: Profile, names) -> np.ndarray:
    return np.column_stack([profile.modules[n].sample_cost_ms for n in names])


def sim_unit_times(profile: Profile) -> np.ndarray:
    """``[batches, global_batch, modules]`` unit times of the batches ``simulated_ms`` resamples
    (``sim_bound.unit_times``; what the bound and the step estimate read)."""
    return unit_times(_draw(profile, profile.graph.names), 1)[0][_sim_batches(profile)]


def _sim_batches(profile: Profile, samples: int = SIM_SAMPLES, seed: int = SIM_SEED) -> np.ndarray:
    """``[batches, global_batch]`` indices into the draw of the simulated global batches."""
    bs = profile.global_batch
    n = len(profile.modules[profile.graph.llm].sample_cost_ms)
    return np.random.default_rng(seed).integers(0, n, (max(1, -(-samples // bs)), bs))


def without_auto(profile: Profile) -> Profile:
    """``profile`` with adaptive SP groups (``sp: auto``) offered to no module."""
    return replace(profile, modules={n: replace(m, adaptive=False) for n, m in profile.modules.items()})


def simulated_ms(profile: Profile, plan_: Plan, samples: int = SIM_SAMPLES, seed: int = SIM_SEED) -> float:
    """Mean simulated iteration (ms) of ``plan_`` on global batches resampled from the profile's
    per-sample draws (``iteration_sim.simulate_iteration``: every replica on its own 1F1B
    timeline, no reordering, as a job runs with ``data.reorder`` off)."""
    draw = _draw(profile, plan_.modules)
    times = sample_times(draw, plan_)
    auto = {n: draw_cost(profile.modules[n].sp_overhead_ms, profile.modules[n].cost_ms[m.tp], m.tp)
            for n, m in plan_.modules.items() if m.sp == AUTO_SP}
    batches = _sim_batches(profile, samples, seed)
    if not auto:  # every batch in one sweep (the same ops as one by one)
        return float(np.mean(simulate_scaled(times[batches], plan_, np.ones((1, len(plan_.modules))))[0]))
    return float(np.mean([simulate_iteration(times[i], plan_, auto=auto).makespan_ms for i in batches]))


def exhaustive_layouts(profile: Profile, aligned: bool = True) -> Iterator[dict[str, Degrees]]:
    """Every feasible layout by nested loops over each module's degrees (small instances only;
    the reference ``exhaustive_plan`` and ``every_layout``'s tests use)."""
    n_gpus, bs, limit = profile.gpus, profile.global_batch, profile.memory_limit_bytes
    names = profile.graph.names
    for dp_llm in range(1, bs + 1):
        d = dp_llm * profile.microbatch
        if bs % d:
            continue
        cands = []
        for n in names:
            spec = profile.modules[n]
            dps = [dp_llm] if n == profile.graph.llm else [x for x in range(1, d + 1) if d % x == 0]
            cands.append([Degrees(dp, tp, pp, sp) for dp in dps
                          for tp in spec.tp_degrees(profile.gpus_per_node)
                          for sp in (*spec.sp_degrees(profile.gpus_per_node, tp),
                                     *((AUTO_SP,) if spec.auto_sp(dp, tp) else ()))
                          for pp in spec.pp_degrees()
                          if dp * tp * pp * max(sp, 1) <= n_gpus])
        for combo in itertools.product(*cands):
            if sum(x.gpus for x in combo) > n_gpus:
                continue
            layout = dict(zip(names, combo))
            if aligned and not tp_aligned(layout, names):
                continue
            if limit is not None and max(layout_memory(profile, layout).values()) > limit:
                continue
            yield layout


def exhaustive_plan(profile: Profile, aligned: bool = True) -> Plan:
    """Reference optimum by brute force over every layout (small instances only; for tests)."""
    names, best, table = profile.graph.names, None, straggler_table(profile)
    for layout in exhaustive_layouts(profile, aligned):
        key = layout_key(t_iter(profile, layout, table).total_ms, layout, names)
        if best is None or key < best[0]:
            best = (key, layout)
    if best is None:
        caps = {n: profile.gpus for n in names}
        if aligned and search(profile, caps, aligned=False) is not None:
            raise PlanError(_unaligned_only(profile, caps))
        raise PlanError(_diagnose(profile, caps))
    return build_plan(profile, best[1], table=table)


_COUNT = {2: "both", 3: "all three"}


def _unaligned_only(profile: Profile, caps: Mapping[str, int]) -> str:
    """Why nothing is feasible when only the node rule stands in the way."""
    found = search(profile, caps, aligned=False)
    shown = ", ".join(f"{n} {d.dp}x{d.tp}x{d.pp} from rank {first}"
                      for n, first in first_ranks(found, profile.graph.names).items()
                      for d in [found[n]])
    capped = " and the GPU caps" if any(caps[n] < profile.gpus for n in caps) else ""
    return (f"no layout within {profile.gpus} GPUs{capped} keeps every TP group inside a node of "
            f"{profile.gpus_per_node} GPUs (each module must start at a multiple of its TP degree; "
            f"the best layout without that rule is {shown})")


def _diagnose(profile: Profile, caps: Mapping[str, int]) -> str:
    """One line naming the constraint that leaves no feasible layout."""
    bs, m, n_gpus = profile.global_batch, profile.microbatch, profile.gpus
    names = profile.graph.names
    if bs % m:
        return f"global_batch {bs} is not divisible by microbatch {m}: no data-parallel degree fits"
    for n in names:
        if not profile.modules[n].cost_ms:
            return f"{n}: none of the profile's TP degrees is one the runtime accepts for this model"
        if not profile.modules[n].tp_degrees(profile.gpus_per_node):
            return (f"{n}: no TP degree in cost_ms ({', '.join(map(str, profile.modules[n].cost_ms))})"
                    f" divides gpus_per_node ({profile.gpus_per_node})")
        if not profile.modules[n].pp_degrees():
            return f"{n}: no pipeline degree divides its {profile.modules[n].layers} layers"
    limit, big = profile.memory_limit_bytes, 1 << 62
    ds = batch_splits(profile)
    need: dict[str, int] = {}
    for n in names:
        sizes = [int(o.gpus.min()) for d in ds if len(o := options(profile, n, d, big, limit))]
        if not sizes:  # only memory can empty a module's options
            everything = [(float(o.mem[i]), o, i) for d in ds
                          if len(o := options(profile, n, d, big, None)) for i in range(len(o))]
            mem, o, i = min(everything, key=lambda x: x[0])
            return (f"{n}: no layout fits in {profile.gpu_memory_gb:g} GiB per GPU (the leanest, "
                    f"dp={o.dp[i]} tp={o.tp[i]} pp={o.pp[i]}, needs {mem / GIB:.1f} GiB)")
        need[n] = min(sizes)
        if need[n] > caps[n] and caps[n] < n_gpus:
            return f"{n} is capped at {caps[n]} GPUs but its smallest feasible layout needs {need[n]}"
    free = sum(min(int(o.gpus.min()) for d in ds if len(o := options(profile, n, d, big, None)))
               for n in names)
    why = " to fit in memory" if sum(need.values()) > free else ""
    split = " + ".join(f"{n} {need[n]}" for n in names)
    if sum(need.values()) > n_gpus:
        return f"needs at least {sum(need.values())} GPUs{why} ({split}), profile has {n_gpus}"
    every = _COUNT.get(len(names), f"all {len(names)}")
    return (f"no single DP_llm * microbatch split of global_batch {bs} lets {every} modules fit "
            f"in {n_gpus} GPUs at once (each alone needs {split})")

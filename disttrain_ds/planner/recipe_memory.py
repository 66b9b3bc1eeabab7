"""The planner's memory figures taken from the recipe a plan is written into, and the runtime's
own check of a plan, so that ``disttrain-plan --write-recipe`` writes a layout the runtime's
start-up memory check (``estimate/memory.py``, ``--dry-run``) accepts.

Both sides use the per-rank formula of :mod:`disttrain_ds.cost.memory_model`, and the planner
prices every stage as the runtime splits the module: ``with_recipe_memory`` gives each module a
stage table (per TP and pipeline degree: each stage's parameters, what one microbatch keeps there
with the input it received and its output, one backward's workspace; ``estimate/memory.py``'s
``module_stages``), so a plan's most loaded rank is the one the runtime's estimate finds, with the
same number. ``fit_plan`` still checks each plan with the runtime's estimate plus each rank's
allowance for what is not tensors (``estimate/gpu_allowance.py``: the part the search does not
price), as a safety net: a refused module's layout is struck off for that module alone and the
search runs again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from disttrain_ds.cost.profile import GIB, Profile
from disttrain_ds.planner.optimize import Plan, PlanError
from disttrain_ds.recipe.graph import sliced_tp_chunks

if TYPE_CHECKING:
    from disttrain_ds.recipe.schema import Recipe


def with_recipe_memory(profile: Profile, recipe: Recipe) -> Profile:
    """``profile`` with every module's memory figures as the runtime estimates them for
    ``recipe``'s model (parameters counted on the meta device; bytes per parameter from its dtype,
    optimizer and ZeRO stage; per-sample activations of its largest sample, and the part TP
    splits; activation checkpointing; per TP and pipeline degree, the runtime's stages), replacing
    whatever the profile said."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.memory import (
        backward_modules,
        extra_bytes,
        layer_params,
        module_layers,
        module_stages,
        reduce_bucket_bytes,
        shared_params,
        stage_bounds,
        stage_params,
        state_bytes,
        vocab_size,
    )

    vocab, backward = vocab_size(recipe), backward_modules(recipe)
    modules = {}
    for name, spec in profile.modules.items():
        w, g, o, sharded = state_bytes(recipe, name)
        lb, params = module_layers(recipe, name, vocab), layer_params(recipe, name, vocab)
        par = recipe.parallel.modules[name]
        act = float(sum(lb.saved)) if backward[name] else 0.0
        split = float(sum(lb.sharded)) / act if act and lb.sharded else 0.0
        pps = [p for p in spec.pp_degrees() if p <= len(params)]
        bounds = {p: stage_bounds(params, p, par.partition) for p in pps}
        shared = shared_params(recipe, name, vocab)
        # Plans are for CUDA clusters: at each TP degree the LLM runs on sequence slices where
        # ``tp_overlap`` (auto: on CUDA) puts it there.
        stages = {(t, p): tuple(module_stages(params, lb, bounds[p], t, par.activation_checkpointing, backward[name],
                                              shared, sliced=sliced_tp_chunks(recipe, name, t, True) > 0))
                  for t in spec.cost_ms for p in pps}
        modules[name] = replace(
            spec, params=float(stage_params(params, 0, len(params), shared)), frozen=g == 0 and o == 0,
            weight_bytes_per_param=w, grad_bytes_per_param=g, optimizer_bytes_per_param=o,
            optimizer_sharded=sharded, activation_bytes_per_sample=act, activation_tp_sharded=min(split, 1.0),
            activation_checkpointing=par.activation_checkpointing,
            layer_output_bytes_per_sample=float(max(lb.outputs, default=0.0)),
            stages=stages, extra_bytes_per_rank=extra_bytes(recipe, name),
            reduce_bucket_bytes=reduce_bucket_bytes(recipe, name))
    return replace(profile, modules=modules)


def runtime_peaks(recipe: Recipe) -> dict[str, float]:
    """The largest per-rank figure the runtime's memory check holds to a GPU's memory for each
    module of ``recipe``, in bytes: estimate plus allowance (``estimate/gpu_allowance.py``; a
    rank several modules share counts for each of them)."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.estimate.memory_check import per_rank_needs

    rows = estimate(recipe, cuda=True)
    totals = per_rank_needs(recipe, rows)
    peaks: dict[str, float] = {}
    for row in rows:
        peaks[row.module] = max([peaks.get(row.module, 0.0), *(totals[r] for r in row.ranks)])
    return peaks


def runtime_peak(recipe: Recipe) -> float:
    """The largest per-rank figure of the runtime's memory check for ``recipe``, in bytes."""
    return max(runtime_peaks(recipe).values())


def fit_plan(profile: Profile, make_plan: Callable[[Profile], Plan],
             recipe_for: Callable[[Plan], Recipe], limit_gib: float) -> Plan:
    """The plan ``make_plan`` finds whose recipe (``recipe_for``) the runtime estimates within
    ``limit_gib`` per rank. With the runtime's stages in the profile (``with_recipe_memory``) the
    first plan passes. Should the runtime still refuse one, the layout of each module it refused is
    struck off for that module alone (``ModuleProfile.refused``; the limit and every other module's
    layouts stay) and the search runs again, so the loop ends, and gives up only when no layout
    is left that the runtime has not refused. Raises PlanError then, naming the last refused plan."""
    current, last, rounds = profile, "", 0
    while True:
        try:
            found = make_plan(current)
        except PlanError as exc:
            if not last:
                raise
            raise PlanError(f"the runtime's memory check refused {rounds} plan(s) (last: {last}) and no other "
                            f"layout fits ({exc})") from None
        peaks = runtime_peaks(recipe_for(found))
        over = {n: b for n, b in peaks.items() if b > limit_gib * GIB}
        if not over:
            return found
        rounds += 1
        shown = ", ".join(f"{n} {m.dp}x{m.tp}x{m.pp}" for n, m in found.modules.items())
        last = f"{shown}: {max(over.values()) / GIB:.3g} GiB on a rank, limit {limit_gib:g} GiB"
        modules = dict(current.modules)
        for n in over:
            m = found.modules[n]
            modules[n] = replace(modules[n], refused=modules[n].refused | {(m.dp, m.tp, m.pp)})
        current = replace(current, modules=modules)

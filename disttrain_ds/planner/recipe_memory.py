"""The planner's memory figures taken from the recipe a plan is written into, and the runtime's
own check of a plan, so that ``disttrain-plan --write-recipe`` never writes a layout the runtime's
start-up memory check (``runtime/memory.py``, ``--dry-run``) refuses.

Both sides use the per-rank formula of :mod:`disttrain_ds.planner.memory_model`. The planner
sees a module as ``layers`` even stages (activations spread evenly), while the runtime counts each
stage's own layers (the LLM's embedding on its first stage, the head's logits on its last), each
stage's received input and output, and one backward workspace; ``fit_plan`` therefore checks
every plan with the runtime's estimate and, while it is refused, plans again under a limit lowered
by the overshoot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from disttrain_ds.planner.optimize import Plan, PlanError
from disttrain_ds.planner.profile import GIB, Profile

if TYPE_CHECKING:
    from disttrain_ds.config import Recipe

ROUNDS = 6
"""Plans tried under lowered limits before giving up."""


def with_recipe_memory(profile: Profile, recipe: Recipe) -> Profile:
    """``profile`` with every module's memory figures as the runtime estimates them for
    ``recipe``'s model (parameters counted on the meta device; bytes per parameter from its dtype,
    optimizer and ZeRO stage; per-sample activations of its largest sample, and the part TP
    splits; activation checkpointing), replacing whatever the profile said."""
    from disttrain_ds.runtime.memory import backward_modules, layer_params, module_layers, state_bytes, vocab_size

    vocab, backward = vocab_size(recipe), backward_modules(recipe)
    modules = {}
    for name, spec in profile.modules.items():
        w, g, o, sharded = state_bytes(recipe, name)
        lb = module_layers(recipe, name, vocab)
        act = float(sum(lb.saved)) if backward[name] else 0.0
        split = float(sum(lb.sharded)) / act if act and lb.sharded else 0.0
        modules[name] = replace(
            spec, params=float(sum(layer_params(recipe, name, vocab))), frozen=g == 0 and o == 0,
            weight_bytes_per_param=w, grad_bytes_per_param=g, optimizer_bytes_per_param=o,
            optimizer_sharded=sharded, activation_bytes_per_sample=act, activation_tp_sharded=min(split, 1.0),
            activation_checkpointing=recipe.parallel.modules[name].activation_checkpointing,
            layer_output_bytes_per_sample=float(max(lb.outputs, default=0.0)))
    return replace(profile, modules=modules)


def runtime_peak(recipe: Recipe) -> float:
    """The largest per-rank estimate of the runtime's memory check for ``recipe``, in bytes."""
    from disttrain_ds.runtime.memory import estimate, per_rank_totals

    return max(per_rank_totals(estimate(recipe)).values())


def fit_plan(profile: Profile, make_plan: Callable[[Profile], Plan],
             recipe_for: Callable[[Plan], Recipe], limit_gib: float) -> Plan:
    """The plan ``make_plan`` finds whose recipe (``recipe_for``) the runtime estimates within
    ``limit_gib`` per rank; each refused plan lowers the planner's limit by its overshoot. Raises
    PlanError naming the last overshoot when ``ROUNDS`` plans are refused or none is left."""
    current, last = profile, ""
    for _ in range(ROUNDS):
        try:
            found = make_plan(current)
        except PlanError as exc:
            if not last:
                raise
            raise PlanError(f"the runtime's memory check refuses the best plan ({last}) and nothing "
                            f"fits a planner limit of {current.gpu_memory_gb:.1f} GiB ({exc})") from None
        peak = runtime_peak(recipe_for(found)) / GIB
        if peak <= limit_gib:
            return found
        shown = ", ".join(f"{n} {m.dp}x{m.tp}x{m.pp}" for n, m in found.modules.items())
        last = f"{shown}: {peak:.1f} GiB on a rank, limit {limit_gib:g} GiB"
        current = replace(current, gpu_memory_gb=current.gpu_memory_gb * limit_gib / peak * 0.999)
    raise PlanError(f"the runtime's memory check refused {ROUNDS} plans in a row (last: {last})")

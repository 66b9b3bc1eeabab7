"""What the runtime accepts, applied to a profile before planning: only runnable plans.

The rules come from the functions recipe validation itself runs (``recipe/checks.py``), on the recipe
the plan will be written into, so a plan and the runtime can never disagree:

* TP: a degree must split every size the module's family lists (``Family.tp_sizes`` and the
  projector widths, via ``validate.tp_shape_problem``); other degrees leave ``cost_ms``;
* PP: at most the module's pipeline layers (``validate.layer_counts``), and 1 for a frozen
  encoder or generator whose projector trains; the planner's own rule (PP divides the profile's
  ``layers``, so stages are even) still holds on top;
* rank placement (every TP group inside one node) is the search's own constraint (``search.py``).

``measured_only`` keeps the degrees whose cost was measured (``cost_source``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from disttrain_ds.cost.profile import TP_DEGREES, Profile
from disttrain_ds.models.configs import trains
from disttrain_ds.planner.optimize import PlanError
from disttrain_ds.recipe.checks import layer_counts, tp_shape_problem
from disttrain_ds.recipe.graph import graph_of, module_config, module_family

if TYPE_CHECKING:
    from disttrain_ds.recipe.schema import Recipe


@dataclass(frozen=True)
class LeftOut:
    """A TP degree of one module the runtime would refuse, and why."""

    module: str
    tp: int
    key: str
    """The recipe key whose size the degree does not split."""
    why: str

    def __str__(self) -> str:
        return f"{self.module} TP={self.tp} ({self.size})"

    @property
    def size(self) -> str:
        """``key value``: the size the degree does not split."""
        return f"{self.key} {self.why.split(' does not split')[0]}"


def runtime_limits(recipe: Recipe) -> tuple[dict[str, tuple[int, ...]], dict[str, int], list[LeftOut]]:
    """Per module of ``recipe``: the TP degrees its sizes split, the largest PP the runtime
    accepts, and the degrees left out with their reasons."""
    graph, counts = graph_of(recipe), layer_counts(recipe)
    tps: dict[str, tuple[int, ...]] = {}
    max_pp: dict[str, int] = {}
    left: list[LeftOut] = []
    for name in graph.names:
        ok = [1]
        for t in TP_DEGREES[1:]:
            bad = tp_shape_problem(recipe, name, t)
            if bad is None:
                ok.append(t)
            else:
                left.append(LeftOut(name, t, *bad))
        tps[name] = tuple(ok)
        cfg = module_config(recipe, name)
        # recipe/checks.py: a frozen encoder/generator whose projector trains runs as one stage.
        frozen_with_projector = name != graph.llm and cfg.frozen and trains(cfg)
        max_pp[name] = 1 if frozen_with_projector else counts[name]
    return tps, max_pp, left


def restrict_to_runtime(profile: Profile, recipe: Recipe) -> tuple[Profile, list[LeftOut]]:
    """``profile`` with only the TP degrees and pipeline degrees ``recipe``'s runtime accepts
    (and the degrees of ``cost_ms`` that were dropped). The profile's modules must be the
    recipe's (``plan.check_recipe_graph`` says so first)."""
    tps, max_pp, left = runtime_limits(recipe)
    modules = {}
    dropped = [x for x in left if x.tp in profile.modules[x.module].cost_ms]
    for name, spec in profile.modules.items():
        cost = {t: c for t, c in spec.cost_ms.items() if t in tps[name]}
        if not cost:
            why = ", ".join(f"TP={x.tp} ({x.size})" for x in dropped if x.module == name)
            raise PlanError(f"{name}: the runtime refuses every TP degree of cost_ms "
                            f"({', '.join(map(str, spec.cost_ms))}): {why}")
        modules[name] = replace(spec, cost_ms=cost, max_pp=max_pp[name],
                                cost_source={t: s for t, s in spec.cost_source.items() if t in cost},
                                **_runtime_sp(recipe, name, spec))
    return replace(profile, modules=modules), dropped


def _runtime_sp(recipe: Recipe, name: str, spec) -> dict:
    """The SP degrees the runtime accepts (``recipe/checks.py``): none in the monolithic layout or a
    family without an SP path; the LLM's divide ``data.seq_len`` (an encoder pads its rows); the
    recipe's heads, which the planner checks per TP degree."""
    if not spec.sp_overhead_ms:
        return {}
    family = module_family(recipe, name)
    if family.sp_heads is None or recipe.layout == "monolithic":
        return {"sp_overhead_ms": {}}
    llm = name == graph_of(recipe).llm
    # Adaptive groups: the LLM's data.seq_len must split over all dp replicas; neither emulated
    # compute nor per-host reading runs them.
    adaptive = not recipe.emulate.enabled and recipe.data.read != "host"
    return {"sp_overhead_ms": {s: c for s, c in spec.sp_overhead_ms.items() if not llm or recipe.data.seq_len % s == 0},
            "attention_heads": family.sp_heads(module_config(recipe, name)),
            "sp_seq_len": recipe.data.seq_len if llm else 0, "adaptive": adaptive}


def measured_only(profile: Profile) -> Profile:
    """``profile`` with only the ``cost_ms`` entries whose ``cost_source`` is ``measured`` (a
    module may be left with none: the planner then names it)."""
    modules = {n: replace(s, cost_ms={t: c for t, c in s.cost_ms.items() if s.source(t) == "measured"},
                          cost_source={t: v for t, v in s.cost_source.items() if v == "measured"})
               for n, s in profile.modules.items()}
    return replace(profile, modules=modules)

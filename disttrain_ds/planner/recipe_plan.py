"""A plan for a recipe as the runtime will load it: only degrees its model allows, memory as its
start-up check counts it, and the recipe overrides that apply the plan.

``disttrain-plan --recipe`` and ``disttrain-launch --elastic`` (re-planning for the GPUs left after
a lost node) share this path, so a plan either of them makes is one the runtime accepts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from disttrain_ds.cost.profile import Profile
from disttrain_ds.errors import ConfigError
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.legal import LeftOut, restrict_to_runtime
from disttrain_ds.planner.optimize import Plan, plan
from disttrain_ds.planner.recipe_memory import fit_plan, with_recipe_memory
from disttrain_ds.recipe.schema import Recipe, load_recipe

AXES = ("dp", "tp", "pp", "sp")
"""The degrees a plan sets per module."""


def parallel_prefix(graph_form: bool) -> str:
    """Where a recipe keeps its modules' degrees: ``parallel.modules`` in graph form, else ``parallel``."""
    return "parallel.modules" if graph_form else "parallel"


def layout_overrides(result: Plan, graph_form: bool) -> list[str]:
    """The ``key=value`` overrides that give a recipe ``result``'s layout and degrees."""
    prefix = parallel_prefix(graph_form)
    return ["layout=disaggregated"] + [f"{prefix}.{n}.{a}={m.sp_setting if a == 'sp' else getattr(m, a)}"
                                       for n, m in result.modules.items() for a in AXES]


def probe_recipe(path: Path | str, graph: ModuleGraph, graph_form: bool, overrides: list[str] = ()) -> Recipe:
    """The base recipe (with ``overrides``) loaded as the runtime will read it, every module at
    dp = tp = pp = sp = 1 (the model sizes decide which degrees are legal, not the base's own degrees)."""
    ones = ["layout=disaggregated"] + [f"{parallel_prefix(graph_form)}.{n}.{a}=1" for n in graph.names for a in AXES]
    try:
        return load_recipe(path, [*overrides, *ones])
    except ConfigError as exc:
        raise ConfigError(f"the base recipe must load to take the runtime's rules from it: {exc}") from None


def runtime_limit(probe: Recipe, profile: Profile) -> float | None:
    """GiB per rank the written recipe's memory check will hold a plan to: its
    ``train.device_memory_gib``, else the profile's ``gpu_memory_gb`` (the cluster's GPUs)."""
    if probe.train.device_memory_gib > 0:
        return probe.train.device_memory_gib
    return profile.gpu_memory_gb


def planned_recipe(path: Path | str, result: Plan, graph_form: bool, overrides: list[str] = ()) -> Recipe:
    """The recipe at ``path`` (with ``overrides``) with ``result``'s degrees, as the runtime will load it."""
    return load_recipe(path, [*overrides, *layout_overrides(result, graph_form)])


def plan_for_recipe(path: Path | str, profile: Profile, graph_form: bool, overrides: list[str] = (),
                    make_plan: Callable[[Profile], Plan] = plan) -> tuple[Plan, Profile, list[LeftOut]]:
    """The best plan of ``profile`` that the recipe at ``path`` (with ``overrides``) runs: degrees
    its model allows, memory as its runtime counts it, and under its memory limit; with the profile
    as restricted and the degrees left out. ``PlanError`` / ``ConfigError`` (one line) otherwise."""
    probe = probe_recipe(path, profile.graph, graph_form, overrides)
    profile, left_out = restrict_to_runtime(profile, probe)
    profile = with_recipe_memory(profile, probe)
    if probe.parallel.post_balance and not profile.post_balance_share:  # price the splits it makes
        profile = replace(profile, post_balance_share=probe.parallel.post_balance_share)
    limit = runtime_limit(probe, profile)
    if limit is None:
        return make_plan(profile), profile, left_out
    # only a plan the runtime's own memory check accepts
    result = fit_plan(profile, make_plan, lambda p: planned_recipe(path, p, graph_form, overrides), limit)
    return result, profile, left_out

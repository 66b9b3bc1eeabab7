"""A plan for a recipe as the runtime will load it: only degrees its model allows, memory as its
start-up check counts it, and the recipe overrides that apply the plan.

``disttrain-plan --recipe``, ``disttrain-launch --elastic`` (re-planning for the GPUs left after
a lost node) and a torchrun worker started with ``--elastic`` on another number of ranks than its
recipe lays out (``worker_plan``) share this path, so a plan any of them makes is one the runtime
accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from disttrain_ds.cost.profile import Profile
from disttrain_ds.errors import ConfigError, plural
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.legal import LeftOut, restrict_to_runtime
from disttrain_ds.planner.optimize import Plan, PlanError, plan
from disttrain_ds.planner.recipe_memory import fit_plan, with_recipe_memory
from disttrain_ds.recipe.graph import graph_of, parallel_key, topology_of
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


def layout_line(result: Plan) -> str:
    """The planned degrees, one module after another."""
    return ", ".join(f"{n} dp={m.dp} tp={m.tp} pp={m.pp}" + (f" sp={m.sp_setting}" if m.sp != 1 else "")
                     for n, m in result.modules.items())


def profile_problem(profile: Profile, recipe: Recipe, src: str) -> str | None:
    """Why ``profile`` (from ``src``) cannot re-plan ``recipe`` (one line), or None: it must lay out
    the recipe's modules for its global and micro batch (another batch would change the data order)."""
    graph = graph_of(recipe)
    if profile.graph != graph:
        return (f"{src}: the profile's modules ({', '.join(profile.graph.names)}) are not the recipe's "
                f"({', '.join(graph.names)}): profile this recipe (disttrain-profile)")
    batch = (recipe.train.global_batch, recipe.train.micro_batch)
    if (profile.global_batch, profile.microbatch) != batch:
        return (f"{src}: made for global batch {profile.global_batch} and micro batch {profile.microbatch}, the "
                f"recipe trains {batch[0]} and {batch[1]}: a re-plan would change the data order; profile this "
                "recipe (disttrain-profile)")
    return None


@dataclass(frozen=True)
class WorkerPlan:
    """A torchrun worker's layout when the job restarted on another number of ranks."""

    overrides: list[str]
    """The recipe's overrides with the planned degrees and ``train.resume=auto`` after them."""
    ranks: int
    """Ranks the new layout runs on: ranks from this one up have nothing to do."""
    line: str
    """What rank 0 says."""


def worker_plan(recipe_path: str, overrides: list[str], recipe: Recipe, profile: Profile, src: str,
                world: int) -> WorkerPlan | None:
    """``--elastic`` under torchrun: None when ``recipe`` lays out ``world`` ranks; else the plan of
    the recipe for ``world`` GPUs (every worker computes the same one), resuming from the newest
    checkpoint. A one-line ``ConfigError`` when the profile does not fit or nothing runs."""
    ranks = topology_of(recipe).world_size
    if ranks == world:
        return None
    why = profile_problem(profile, recipe, src)
    if why:
        raise ConfigError(why)
    graph_form = parallel_key(recipe, graph_of(recipe).llm).startswith("parallel.modules.")
    try:
        result, _, _ = plan_for_recipe(recipe_path, replace(profile, gpus=world), graph_form, overrides)
    except (ConfigError, PlanError) as exc:
        raise ConfigError(f"elastic: the recipe lays out {plural(ranks, 'rank')}, {world} started; cannot "
                          f"re-plan it for them: {exc}") from None
    idle = f", {plural(world - result.gpus, 'rank')} idle" if result.gpus < world else ""
    return WorkerPlan([*overrides, *layout_overrides(result, graph_form), "train.resume=auto"], result.gpus,
                      f"elastic: the recipe lays out {plural(ranks, 'rank')}, {world} started; re-planned for "
                      f"{plural(result.gpus, 'GPU')}{idle}: {layout_line(result)}; resuming from the newest checkpoint")

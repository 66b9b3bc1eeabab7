"""Plan a disaggregated layout from a profile, and optionally write it into a recipe.

    disttrain-plan --profile P.json [--json] [--measured-only] [--recipe base.yaml]
    disttrain-plan --profile P.json --write-recipe out.yaml --recipe base.yaml [--force]

(``python -m disttrain_ds.cli.plan`` is the same command.) ``--recipe`` takes a YAML path or the name of
a shipped recipe (``mllm_9b``). For a module graph (profile modules other than encoder/llm/generator)
the base recipe is a graph-form one (``model.modules``) with the profile's modules, and the plan
goes into ``parallel.modules.<name>``. With ``--recipe`` the plan only uses degrees the runtime
accepts for that recipe's model (``planner/legal.py``), and a recipe is written only if it loads.
Every plan says which of its costs were measured and which were interpolated or assumed.

Errors (bad profile, no feasible layout, missing files, refusing to overwrite) are one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from disttrain_ds.cli import OneLineParser, prog_name
from disttrain_ds.configtools import load_yaml
from disttrain_ds.cost.profile import Profile
from disttrain_ds.cost.profile_file import load_profile
from disttrain_ds.errors import ConfigError
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.legal import LeftOut, measured_only
from disttrain_ds.planner.optimize import Plan, PlanError, plan
from disttrain_ds.planner.recipe_plan import plan_for_recipe
from disttrain_ds.recipe.checks import graph_problem
from disttrain_ds.recipe.graph import raw_module_family, raw_module_sections
from disttrain_ds.recipe.schema import find_recipe, load_recipe

PROG = prog_name("disttrain-plan", "python -m disttrain_ds.cli.plan")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    ap = OneLineParser(prog=PROG, description="Find the layout (per-module DP/TP/PP) that minimises "
                 "the predicted iteration time of a disaggregated multimodal LLM.")
    ap.add_argument("--profile", required=True, type=Path, help="profile JSON (docs/planner.md)")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    ap.add_argument("--write-recipe", type=Path, metavar="OUT",
                    help="write --recipe with layout and parallel degrees set to the plan")
    ap.add_argument("--recipe", type=Path, metavar="BASE", help="base recipe: YAML path or shipped recipe name")
    ap.add_argument("--force", action="store_true", help="overwrite --write-recipe's file")
    ap.add_argument("--measured-only", action="store_true",
                    help="consider only the TP degrees whose cost was measured (cost_source)")
    return ap


def format_plan(profile: Profile, result: Plan, source: str = "") -> str:
    """Human-readable table of ``result``."""
    head = f"profile {source}: " if source else ""
    width = max(10, *(len(n) for n in result.modules))  # 10: the classic three names' column
    lines = [f"{head}{profile.gpus} GPUs, global batch {profile.global_batch}, microbatch "
             f"{profile.microbatch} -> {result.microbatches} pipeline steps per iteration", "",
             f"{'module':<{width}} {'GPUs':>6} {'DP':>5} {'TP':>3} {'PP':>3} "
             + ("  SP " if any(m.sp != 1 for m in result.modules.values()) else "")
             + f"{'samples/mb':>10} {'stage ms':>10} {'mem GiB':>8}"]
    with_sp = any(m.sp != 1 for m in result.modules.values())
    for n, m in result.modules.items():
        mem = f"{m.memory_gib:.1f}" if m.memory_gib is not None else "-"
        sp = f"{m.sp_setting:>4} " if with_sp else ""
        lines.append(f"{n:<{width}} {m.gpus:>6} {m.dp:>5} {m.tp:>3} {m.pp:>3} " + sp
                     + f"{m.samples_per_microbatch:>10} {m.stage_ms:>10.1f} {mem:>8}")
    lines.append(f"{'total':<{width}} {result.gpus:>6}   ({profile.gpus - result.gpus} of "
                 f"{profile.gpus} left idle)")
    if result.graph != ModuleGraph.default():
        lines.append("module graph: " + ", ".join(f"{u} -> {v}" for u, v in result.graph.edges))
    mfu = f"{result.mfu * 100:.1f} %" if result.mfu is not None else \
        "n/a (needs flops_per_sample and peak_tflops)"
    if profile.has_draw:
        lines += ["", "straggler factors from the sample_cost_ms draw (expected slowest replica"
                  " / mean replica load): h per microbatch crossing the module, g per step"
                  " with PP microbatches in flight"]
        lines += [f"  {n:<{width}} h {m.straggler:6.3f}   g {m.pace:6.3f}"
                  for n, m in result.modules.items()]
        if profile.post_balance_share:
            lines.append(f"  (post-balanced: every module but the LLM splits a step by its own costs, up to "
                         f"{profile.post_balance_share:g} x the even share per replica)")
    lines += ["", f"T_warmup  {result.t_warmup_ms:12.1f} ms",
              f"T_steady  {result.t_steady_ms:12.1f} ms",
              f"T_iter    {result.t_iter_ms:12.1f} ms   (closed form the search minimises)",
              f"T_pred    {result.t_pred_ms:12.1f} ms   (the runtime's 1F1B schedule over these"
              " stage times)"]
    if result.t_sim_ms is not None:
        lines.append(f"T_sim     {result.t_sim_ms:12.1f} ms   (simulated on batches resampled from the draw: the "
                     f"fastest of {result.finalists} finalists)")
    lines.append(f"predicted MFU  {mfu}")
    return "\n".join(lines)


def format_costs(profile: Profile, result: Plan, left_out: list[LeftOut] = ()) -> str:
    """Where every cost the plan could use comes from, per module and TP degree (``*``: the
    plan's degree), what the runtime ruled out, and a warning when the plan rests on costs that
    were not measured."""
    width = max(10, *(len(n) for n in result.modules))
    lines = ["", "cost_ms sources (* = the plan's TP degree):"]
    for n, spec in profile.modules.items():
        cells = [f"TP={t}{'*' if t == result.module(n).tp else ''} {spec.source(t)}"
                 for t in spec.tp_degrees(profile.gpus_per_node)]
        lines.append(f"  {n + ':':<{width + 1}} " + ", ".join(cells))
    if left_out:
        lines.append("left out, the runtime refuses them: " + ", ".join(map(str, left_out)))
    unmeasured = [f"{n} TP={m.tp} ({m.cost_source})" for n, m in result.modules.items()
                  if m.cost_source != "measured"]
    if unmeasured:
        lines.append(f"warning: the predicted times rest on costs that were not measured: "
                     f"{', '.join(unmeasured)}; measure them (disttrain-profile --measure-tp) or "
                     "plan with --measured-only")
    return "\n".join(lines)


def recipe_with_plan(base: dict[str, Any], result: Plan, src: str = "<recipe>") -> dict[str, Any]:
    """A copy of ``base`` with ``layout: disaggregated`` and each module's parallel degrees
    (``dp``, ``tp``, ``pp``) set from ``result``; every other key is left as it was.

    A three-module recipe (``model.encoder`` ...) gets ``parallel.<encoder|llm|generator>``; a
    graph-form recipe (``model.modules``) gets ``parallel.modules.<name>``, and its modules must
    be the plan's: the same names with the same roles (one-line ConfigError naming both lists)."""
    out = json.loads(json.dumps(base))  # deep copy of plain YAML data
    graph_form = check_recipe_graph(out, result.graph, src)
    out["layout"] = "disaggregated"
    parallel = out.setdefault("parallel", {})
    if not isinstance(parallel, dict):
        raise ConfigError(f"{src}: 'parallel' must be a mapping")
    prefix = "parallel"
    if graph_form:
        parallel = _mapping(parallel, "modules", src, "parallel.modules")
        prefix = "parallel.modules"
    for n in result.modules:
        section = _mapping(parallel, n, src, f"{prefix}.{n}")
        m = result.module(n)
        section.update(dp=m.dp, tp=m.tp, pp=m.pp)
        if m.sp != 1 or "sp" in section:
            section["sp"] = m.sp_setting
    return out


def check_recipe_graph(base: dict[str, Any], graph: ModuleGraph, src: str) -> bool:
    """Whether ``base`` is a graph-form recipe; one-line ConfigError unless its modules are
    ``graph``'s (same names, same roles) and the runtime can train that graph."""
    recipe_graph = base_recipe_graph(base, src)
    check_runtime_graph(graph, src, base_modalities(base, src).get if recipe_graph == graph else None)
    if recipe_graph is None:  # three-module form
        if graph != ModuleGraph.default():
            raise ConfigError(f"{src}: a three-module recipe has encoder (encoder), llm (llm), generator "
                              f"(generator) but the profile's modules are {_describe(graph)}: give "
                              "--recipe a recipe whose model.modules has the profile's module names")
    elif recipe_graph != graph:
        raise ConfigError(f"{src}: 'model.modules' has {_describe(recipe_graph)} but the profile's "
                          f"modules are {_describe(graph)}: the base recipe needs the profile's "
                          "module names with the same roles")
    return recipe_graph is not None


def _mapping(parent: dict[str, Any], key: str, src: str, where: str) -> dict[str, Any]:
    """``parent[key]``, created empty when absent or null; one-line error unless a mapping."""
    if parent.get(key) is None:
        parent[key] = {}
    if not isinstance(parent[key], dict):
        raise ConfigError(f"{src}: '{where}' must be a mapping")
    return parent[key]


def _describe(graph: ModuleGraph) -> str:
    return ", ".join(f"{n} ({graph.role(n)})" for n in graph.names)


def base_recipe_graph(base: dict[str, Any], src: str) -> ModuleGraph | None:
    """The module graph of a graph-form recipe's raw data (``model.modules``; each module's role
    is its family's), or None for a three-module recipe."""
    sections = raw_module_sections(base, src)
    if sections is None:
        return None
    return ModuleGraph.from_roles({n: raw_module_family(sections, n, src).role for n in sections}, src)


def base_modalities(base: dict[str, Any], src: str) -> dict[str, str]:
    """Encoder name -> what it reads (its family's modality) in a graph-form recipe's raw data;
    empty for a three-module recipe."""
    sections = raw_module_sections(base, src)
    return {n: raw_module_family(sections, n, src).modality for n in sections} if sections is not None else {}


def check_runtime_graph(graph: ModuleGraph, src: str, modality=None) -> None:
    """One-line ConfigError when the runtime cannot train ``graph`` (the runtime's own rule,
    ``validate.graph_problem``; ``modality``: encoder name -> what it reads, when a base recipe
    says), so a recipe for it would not load."""
    bad = graph_problem(graph, modality)
    if bad is not None:
        raise ConfigError(f"{src}: cannot write a recipe for the module graph {', '.join(graph.names)}: {bad}, "
                          "so the recipe would not load; plan without --write-recipe")


def write_checked(recipe: dict[str, Any], out: Path) -> None:
    """Write ``recipe`` to ``out`` only if it loads there with ``load_recipe`` (relative paths
    resolve beside ``out``, as they will for its user); one-line ConfigError otherwise, with
    ``out`` left as it was."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.yaml")
    try:
        tmp.write_text(yaml.safe_dump(recipe, sort_keys=False))
        try:
            load_recipe(tmp)
        except ConfigError as exc:
            raise ConfigError(f"{out}: not written, the recipe would not load: "
                              + str(exc).replace(str(tmp), str(out))) from None
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def memory_problem(path: Path, profile: Profile) -> str:
    """Why the runtime's start-up memory check (``estimate/memory.py``, as ``--dry-run``, with the
    allowance of ``estimate/gpu_allowance.py`` beside each rank's estimate) would
    refuse the recipe at ``path``, or "" (also when ``train.device_memory_gib`` is unset). With
    ``--recipe`` the plan already passed that check (``planner/recipe_memory.fit_plan``); this
    stays as the last word on the file actually written."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.estimate.memory_check import check_fits

    recipe = load_recipe(path)
    if recipe.train.device_memory_gib <= 0:
        return ""
    try:
        check_fits(recipe, estimate(recipe, cuda=True), recipe.train.device_memory_gib, "train.device_memory_gib")
    except ConfigError as exc:
        blind = [n for n, s in profile.modules.items() if s.activation_bytes_per_sample == 0]
        why = f" (the profile has no activation_bytes_per_sample for {', '.join(blind)})" if blind else ""
        return f"the runtime's memory check would stop it at start-up{why}: " + \
            str(exc).removeprefix(f"{path}: ").split("; more ranks")[0]
    return ""


def batch_mismatches(recipe: dict[str, Any], profile: Profile) -> list[str]:
    """The recipe's batch settings that differ from the profile the plan was made for (the
    plan's divisibility and times assume the profile's)."""
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    out = []
    for key, want in (("global_batch", profile.global_batch), ("micro_batch", profile.microbatch)):
        if key in train and train[key] != want:
            out.append(f"train.{key} is {train[key]!r} but the plan assumes {want} (left as is)")
    return out


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def plan_measured_only(profile: Profile) -> Plan:
    """The plan over measured costs only; one line naming a module and degree when there is none."""
    kept = measured_only(profile)
    for name, spec in kept.modules.items():
        if not spec.cost_ms:
            have = ", ".join(f"TP={t} {profile.modules[name].source(t)}" for t in profile.modules[name].cost_ms)
            raise PlanError(f"--measured-only: {name} has no measured cost ({have or 'none left'}); "
                            f"measure it with disttrain-profile (--measure-tp for TP > 1)")
    try:
        return plan(kept)
    except PlanError as exc:
        try:
            full = plan(profile)
        except PlanError:
            raise exc from None
        unmeasured = [(n, m.tp, m.cost_source) for n, m in full.modules.items() if m.cost_source != "measured"]
        n, t, source = unmeasured[0]
        raise PlanError(f"--measured-only: nothing feasible with measured costs only ({exc}); the best "
                        f"plan needs {n} TP={t}, whose cost is {source}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.write_recipe is not None and args.recipe is None:
        return _fail("--write-recipe and --recipe go together")
    left_out: list[LeftOut] = []
    try:
        profile = load_profile(args.profile)
        if args.recipe is not None:
            check_runtime_graph(profile.graph, f"{args.profile}: 'modules'")
            base_path = find_recipe(args.recipe)
            base = load_yaml(base_path)
            graph_form = check_recipe_graph(base, profile.graph, str(args.recipe))
            if args.write_recipe is not None and args.write_recipe.exists() and not args.force:
                return _fail(f"{args.write_recipe}: already exists (use --force to overwrite)")
        make_plan = plan_measured_only if args.measured_only else plan
        if args.recipe is None:
            result = make_plan(profile)
        else:
            result, profile, left_out = plan_for_recipe(base_path, profile, graph_form, make_plan=make_plan)
        if args.write_recipe is not None:
            recipe = recipe_with_plan(base, result, str(args.recipe))
    except (ConfigError, PlanError) as exc:
        return _fail(str(exc))
    if args.write_recipe is not None:
        try:
            write_checked(recipe, args.write_recipe)  # never a recipe that does not load
        except ConfigError as exc:
            return _fail(str(exc))
        except OSError as exc:
            return _fail(f"{args.write_recipe}: cannot write ({exc.strerror})")
        print(f"wrote {args.write_recipe}", file=sys.stderr)
        problem = memory_problem(args.write_recipe, profile)
        if problem:
            print(f"{PROG}: warning: {args.write_recipe}: {problem}", file=sys.stderr)
        for line in batch_mismatches(base, profile):
            print(f"{PROG}: warning: {args.recipe}: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_plan(profile, result, str(args.profile)))
        print(format_costs(profile, result, left_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

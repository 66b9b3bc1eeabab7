"""Plan a disaggregated layout from a profile, and optionally write it into a recipe.

    disttrain-plan --profile P.json [--json]
    disttrain-plan --profile P.json --write-recipe out.yaml --recipe base.yaml [--force]

(``python -m disttrain_ds.plan`` is the same command.) ``--recipe`` takes a YAML path or the name of
a shipped recipe (``mllm_9b``).

Errors (bad profile, no feasible layout, missing files, refusing to overwrite) are one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from disttrain_ds.cli import OneLineParser, prog_name
from disttrain_ds.config import find_recipe
from disttrain_ds.configtools import ConfigError, load_yaml
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.optimize import Plan, PlanError, plan
from disttrain_ds.planner.profile import Profile, load_profile

PROG = prog_name("disttrain-plan", "python -m disttrain_ds.plan")


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
    return ap


def format_plan(profile: Profile, result: Plan, source: str = "") -> str:
    """Human-readable table of ``result``."""
    head = f"profile {source}: " if source else ""
    width = max(10, *(len(n) for n in result.modules))  # 10: the classic three names' column
    lines = [f"{head}{profile.gpus} GPUs, global batch {profile.global_batch}, microbatch "
             f"{profile.microbatch} -> {result.microbatches} pipeline steps per iteration", "",
             f"{'module':<{width}} {'GPUs':>6} {'DP':>5} {'TP':>3} {'PP':>3} {'samples/mb':>10} "
             f"{'stage ms':>10} {'mem GiB':>8}"]
    for n, m in result.modules.items():
        mem = f"{m.memory_gib:.1f}" if m.memory_gib is not None else "-"
        lines.append(f"{n:<{width}} {m.gpus:>6} {m.dp:>5} {m.tp:>3} {m.pp:>3} "
                     f"{m.samples_per_microbatch:>10} {m.stage_ms:>10.1f} {mem:>8}")
    lines.append(f"{'total':<{width}} {result.gpus:>6}   ({profile.gpus - result.gpus} of "
                 f"{profile.gpus} left idle)")
    if result.graph != ModuleGraph.default():
        lines.append("module graph: " + ", ".join(f"{u} -> {v}" for u, v in result.graph.edges))
    mfu = f"{result.mfu * 100:.1f} %" if result.mfu is not None else \
        "n/a (needs flops_per_sample and peak_tflops)"
    lines += ["", f"T_warmup  {result.t_warmup_ms:12.1f} ms",
              f"T_steady  {result.t_steady_ms:12.1f} ms",
              f"T_iter    {result.t_iter_ms:12.1f} ms", f"predicted MFU  {mfu}"]
    return "\n".join(lines)


def recipe_with_plan(base: dict[str, Any], result: Plan, src: str = "<recipe>") -> dict[str, Any]:
    """A copy of ``base`` with ``layout: disaggregated`` and ``parallel.<module>.{dp,tp,pp}``
    set from ``result``; every other key is left as it was. Only for the three-module graph."""
    check_recipe_graph(result.graph, src)
    out = json.loads(json.dumps(base))  # deep copy of plain YAML data
    out["layout"] = "disaggregated"
    parallel = out.setdefault("parallel", {})
    if not isinstance(parallel, dict):
        raise ConfigError(f"{src}: 'parallel' must be a mapping")
    for n in result.modules:
        section = parallel.setdefault(n, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{src}: 'parallel.{n}' must be a mapping")
        m = result.module(n)
        section.update(dp=m.dp, tp=m.tp, pp=m.pp)
    return out


def check_recipe_graph(graph: ModuleGraph, src: str) -> None:
    """One-line ConfigError unless ``graph`` is the encoder -> llm -> generator graph that a
    recipe without a graph section describes."""
    if graph != ModuleGraph.default():
        raise ConfigError(f"{src}: cannot write a recipe for the module graph "
                          f"{', '.join(graph.names)}: recipes with a module graph are written once "
                          "the recipe format has a graph section")


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


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if (args.write_recipe is None) != (args.recipe is None):
        return _fail("--write-recipe and --recipe go together")
    try:
        profile = load_profile(args.profile)
        if args.write_recipe is not None:
            check_recipe_graph(profile.graph, f"{args.profile}: 'modules'")
        result = plan(profile)
        if args.write_recipe is not None:
            if args.write_recipe.exists() and not args.force:
                return _fail(f"{args.write_recipe}: already exists (use --force to overwrite)")
            base = load_yaml(find_recipe(args.recipe))
            recipe = recipe_with_plan(base, result, str(args.recipe))
    except (ConfigError, PlanError) as exc:
        return _fail(str(exc))
    if args.write_recipe is not None:
        try:
            args.write_recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
        except OSError as exc:
            return _fail(f"{args.write_recipe}: cannot write ({exc.strerror})")
        print(f"wrote {args.write_recipe}", file=sys.stderr)
        for line in batch_mismatches(base, profile):
            print(f"{PROG}: warning: {args.recipe}: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_plan(profile, result, str(args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

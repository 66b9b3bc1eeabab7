"""What ``tools/train.py`` runs: load the recipe, check that every rank fits in memory, pick the
layout, train; or, for ``--dry-run``, only print the rank map and each rank's memory estimate."""

from __future__ import annotations

import os
import time

from disttrain_ds.console import Console
from disttrain_ds.cost.profile_file import load_profile
from disttrain_ds.errors import ConfigError
from disttrain_ds.metrics.rundir import make_run_dir, write_resolved_recipe
from disttrain_ds.planner.recipe_plan import worker_plan
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import Recipe, load_recipe
from disttrain_ds.runtime import guards


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment: 'WORLD_SIZE' must be an integer, got {raw!r}") from None


QUIET_RANK_DELAY_S = 2.0
"""How long a rank other than 0 waits before exiting on a ``ConfigError`` (rank 0 reports it)."""


def run(recipe_path: str, overrides: list[str], elastic: str | None = None) -> int:
    """Train; ``elastic``: a planner profile to re-plan the recipe from when the launcher started
    another number of ranks than it lays out (torchrun after losing a node)."""
    try:
        return _run(recipe_path, overrides, elastic)
    except ConfigError:
        if os.environ.get("RANK", "0") != "0":
            # Every rank hits the same error and only rank 0 prints it; a launcher that stops the
            # job at the first exit would otherwise end rank 0 before it has said why.
            time.sleep(QUIET_RANK_DELAY_S)
        raise


def _run(recipe_path: str, overrides: list[str], elastic: str | None = None) -> int:
    recipe = load_recipe(recipe_path, overrides)
    world = world_size_from_env()
    if elastic is not None and recipe.layout != "reference":
        replanned = worker_plan(recipe_path, overrides, recipe, load_profile(elastic), elastic, world)
        if replanned is not None:
            rank = int(os.environ.get("RANK", "0"))
            if rank == 0:
                print(replanned.line, flush=True)
            if rank >= replanned.ranks:
                return 0  # before any process group: the others start one of their size
            os.environ["WORLD_SIZE"] = str(world := replanned.ranks)
            recipe = load_recipe(recipe_path, replanned.overrides)
    if recipe.layout == "reference":
        if world > 1:
            raise ConfigError(
                f"{recipe_path}: 'layout' reference runs in one process but {world} processes were launched; "
                "run it without a launcher or choose layout=disaggregated"
            )
        rows = check_memory(recipe, ranks_per_host=1)
        check_output_dirs(recipe, rows)
        check_imports(recipe)
        # deferred: loads torch (safetensors too)
        from disttrain_ds.runtime.reference import train_reference

        run_dir = make_run_dir(recipe.logging.dir, recipe.name)
        write_resolved_recipe(run_dir, recipe)
        print(f"recipe {recipe_path}: layout reference, {recipe.train.steps} steps, run dir {run_dir}", flush=True)
        train_reference(recipe, run_dir, log=lambda line: print(line, flush=True))
        print(f"metrics: {run_dir / 'metrics.jsonl'}", flush=True)
        return 0
    # Before the runtime (DeepSpeed) is imported and before any process group starts.
    topology_of(recipe).check_world(world, recipe.source_file)
    rows = check_memory(recipe, ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    check_output_dirs(recipe, rows)  # writable run and checkpoint directories, room for a checkpoint
    check_imports(recipe)  # the weights it starts from cover every module they are given for

    console = Console.start(int(os.environ.get("RANK", "0")))  # library output to a log from here on
    # deferred: loads torch (deepspeed, safetensors, transformers too)
    from disttrain_ds.runtime.distributed import train_distributed

    try:
        return train_distributed(recipe, console=console, memory_rows=rows)
    except ConfigError:
        console.discard()
        raise


def check_memory(recipe: Recipe, ranks_per_host: int) -> list:
    """Stop with one line naming the rank and module whose estimated peak memory does not fit;
    returns the estimate's rows."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.estimate.memory_check import check_fits, device_limit_gib, limit_is_gpu

    limit, source = device_limit_gib(recipe, ranks_per_host)
    rows = estimate(recipe)
    check_fits(recipe, rows, limit, source, gpu=limit_is_gpu(recipe))
    return rows


def check_imports(recipe: Recipe) -> None:
    """Stop with one line naming ``model.<module>.checkpoint`` when it would leave weights at random
    init or does not fit the module's shapes."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.runtime.imports import check_imports as check

    check(recipe)


def check_output_dirs(recipe: Recipe, rows: list) -> None:
    """Stop with one line naming ``logging.dir`` or ``checkpoint.dir`` when it cannot be written or
    (checkpoints) has no room for one checkpoint."""
    guards.check_output_dirs(recipe, rows)


def dry_run(recipe_path: str, overrides: list[str], out=print) -> int:
    """Print the rank map and every rank's estimated peak memory; no processes, no weights.

    Raises ``ConfigError`` (one line naming the rank and module) when a rank does not fit."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.estimate.memory_check import check_fits, describe, device_limit_gib, limit_is_gpu

    recipe = load_recipe(recipe_path, overrides)
    if recipe.layout == "reference":
        ranks = 1
        out("layout reference: 1 rank (encoder, llm and generator in one process)")
    else:
        topo = topology_of(recipe)
        ranks = topo.world_size
        out(topo.describe())
    limit, source = device_limit_gib(recipe, int(os.environ.get("LOCAL_WORLD_SIZE", ranks)))
    rows, gpu = estimate(recipe), limit_is_gpu(recipe)
    for line in describe(recipe, rows, limit, source, gpu):
        out(line)
    check_fits(recipe, rows, limit, source, gpu)
    out(f"recipe {recipe.source_file}: fits (dry run: nothing started)")
    return 0

"""What ``tools/train.py`` runs: load the recipe, pick the layout, train."""

from __future__ import annotations

import os
import time

from .config import load_recipe
from .configtools import ConfigError
from .topology import Topology


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment: 'WORLD_SIZE' must be an integer, got {raw!r}") from None


QUIET_RANK_DELAY_S = 2.0
"""How long a rank other than 0 waits before exiting on a ``ConfigError`` (rank 0 reports it)."""


def run(recipe_path: str, overrides: list[str]) -> int:
    try:
        return _run(recipe_path, overrides)
    except ConfigError:
        if os.environ.get("RANK", "0") != "0":
            # Every rank hits the same error and only rank 0 prints it; a launcher that stops the
            # job at the first exit would otherwise end rank 0 before it has said why.
            time.sleep(QUIET_RANK_DELAY_S)
        raise


def _run(recipe_path: str, overrides: list[str]) -> int:
    recipe = load_recipe(recipe_path, overrides)
    world = world_size_from_env()
    if recipe.layout == "reference":
        if world > 1:
            raise ConfigError(
                f"{recipe_path}: 'layout' reference runs in one process but {world} processes were launched; "
                "run it without a launcher or choose layout=disaggregated"
            )
        from .runtime.reference import train_reference
        from .runtime.rundir import make_run_dir, write_resolved_recipe

        run_dir = make_run_dir(recipe.logging.dir, recipe.name)
        write_resolved_recipe(run_dir, recipe)
        print(f"recipe {recipe_path}: layout reference, {recipe.train.steps} steps, run dir {run_dir}", flush=True)
        train_reference(recipe, run_dir, log=lambda line: print(line, flush=True))
        print(f"metrics: {run_dir / 'metrics.jsonl'}", flush=True)
        return 0
    # Before the runtime (DeepSpeed) is imported and before any process group starts.
    Topology.from_recipe(recipe).check_world(world, recipe.source_file)
    from .runtime.distributed import train_distributed

    return train_distributed(recipe)



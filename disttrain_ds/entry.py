"""What ``tools/train.py`` runs: load the recipe, pick the layout, train."""

from __future__ import annotations

import os


from .config import load_recipe
from .configtools import ConfigError


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(recipe_path: str, overrides: list[str]) -> int:
    recipe = load_recipe(recipe_path, overrides)
    world = world_size_from_env()
    if recipe.layout == "reference":
        if world > 1:
            raise ConfigError(
                f"{recipe_path}: layout 'reference' runs in one process but {world} were launched; "
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
    from .runtime.distributed import train_distributed

    return train_distributed(recipe)



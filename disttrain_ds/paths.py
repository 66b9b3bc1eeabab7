"""Where the files a recipe names are found: beside the recipe, in the working directory, in the package."""

from __future__ import annotations

from pathlib import Path

from disttrain_ds.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
"""The package, with its shipped ``recipes/*.yaml`` and ``ds_configs/*.json``."""


def path_candidates(path: str | Path, recipe_file: str | Path = "") -> list[Path]:
    """Where a relative path in a recipe may be, in order: beside the recipe file, in the working
    directory, in the package's shipped data (``ds_configs/zero1.json``). An absolute path is itself."""
    p = Path(path)
    if p.is_absolute():
        return [p]
    bases = [Path(recipe_file).absolute().parent] if recipe_file else []
    return list(dict.fromkeys(base / p for base in (*bases, Path.cwd(), PACKAGE_DIR)))


def resolve_path(path: str | Path, recipe_file: str | Path = "") -> Path:
    """The first of ``path_candidates`` that exists, else ``path`` unchanged."""
    return next((c for c in path_candidates(path, recipe_file) if c.exists()), Path(path))


def require_file(path: str | Path, key: str, recipe_src: str, recipe_file: str | Path = "") -> Path:
    """The file a recipe's ``key`` names; a one-line ``ConfigError`` naming the key and the
    places tried when there is none."""
    candidates = path_candidates(path, recipe_file)
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None:
        return found
    if len(candidates) == 1:
        what = " (a directory)" if candidates[0].is_dir() else ""
        raise ConfigError(f"{recipe_src}: '{key}' file not found: {path}{what}")
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"{recipe_src}: '{key}' file not found: {path} (tried {tried})")

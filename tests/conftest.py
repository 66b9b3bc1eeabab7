"""Shared test helpers: where the read-only fixtures live, and marker handling."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def ig():
    """``tools/import_graph.py`` (the package's import graph and floors), loaded as a module."""
    spec = importlib.util.spec_from_file_location("import_graph", REPO_ROOT / "tools" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", mod)  # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Directory of the read-only data fixtures beside the repository; skips if absent."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"fixtures not found at {SHARED_FIXTURES}")
    return SHARED_FIXTURES


@pytest.fixture
def run_main(capsys):
    """Call a command-line ``main(argv)``; returns (exit code, stdout, stderr), argparse exits included."""

    def call(main, *argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return call


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing: pure tests still run
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_recipe():
    """The default tiny recipe, loaded and validated."""
    from disttrain_ds.recipe.schema import load_recipe

    return load_recipe(REPO_ROOT / "recipes" / "tiny_cpu.yaml")


@pytest.fixture(scope="session")
def tiny_source_and_spec(tiny_recipe):
    from disttrain_ds.runtime.setup import build_data_and_spec

    return build_data_and_spec(tiny_recipe)


@pytest.fixture(scope="session")
def tiny_spec(tiny_source_and_spec):
    return tiny_source_and_spec[1]


@pytest.fixture(scope="session")
def tiny_samples(tiny_source_and_spec):
    return tiny_source_and_spec[0].global_batch(0)[:2]

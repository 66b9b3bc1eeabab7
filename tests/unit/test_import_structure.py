"""The package's imports point down: no cycle (imports inside functions counted), and imports
inside functions only where they defer a heavy third-party library, never to dodge a cycle.

``python tools/import_graph.py --list`` shows the same findings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", TOOLS / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", mod)
    spec.loader.exec_module(mod)
    return mod


ig = _graph_module()

INTERNAL_INSIDE_FUNCTIONS_AT_MOST = 145
"""Internal imports still written inside functions (each an upward import in disguise); the number
may only go down as the package's layers are cleaned up."""


@pytest.fixture(scope="module")
def graph():
    return ig.read_graph()


def test_the_package_has_no_import_cycle(graph):
    found = ig.cycles(graph.edges)
    assert not found, "import cycles (imports inside functions counted): " + "; ".join(" -> ".join(c) for c in found)


def test_internal_imports_inside_functions_only_go_down_in_number(graph):
    n = len(graph.local)
    assert n <= INTERNAL_INSIDE_FUNCTIONS_AT_MOST, (
        f"{n} internal imports inside functions (at most {INTERNAL_INSIDE_FUNCTIONS_AT_MOST}): import at module "
        "level, or move the definition down a layer; newest: " + ", ".join(f"{m}:{line}" for m, line, _ in graph.local[-3:]))


def test_third_party_imports_inside_functions_defer_heavy_libraries_only(graph):
    light = sorted({(m, line, t) for m, line, t in graph.local_third_party if t not in ig.HEAVY})
    allowed = {"importlib", "tempfile", "traceback", "subprocess", "multiprocessing", "inspect", "shutil",
               "socket", "signal", "platform", "ctypes", "resource", "getpass", "gc", "tracemalloc", "random"}
    odd = [f"{m}:{line} imports {t}" for m, line, t in light if t not in allowed]
    assert not odd, "imports inside functions of libraries that cost nothing to import at the top: " + "; ".join(odd)


def test_cycle_finder_catches_a_cycle_through_an_import_inside_a_function(tmp_path):
    """Negative control: a loop closed by a function-local import is a cycle."""
    pkg = tmp_path / "disttrain_ds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n    return g\n")
    found = ig.read_graph(pkg)
    assert ig.cycles(found.edges) == [["disttrain_ds.a", "disttrain_ds.b"]]
    assert found.local == [("disttrain_ds.b", 2, "disttrain_ds.a")]


def test_upward_imports_are_found_from_a_layer_map():
    edges = {"p.low": {"p.high"}, "p.high": {"p.low"}}
    assert ig.upward(edges, {"p.low": 1, "p.high": 2}) == [("p.low", "p.high")]

"""The package's imports point down: no cycle (imports inside functions counted), every import to a
lower floor (``tools/import_graph.py::FLOORS``), and imports inside functions only where they defer a
slow third-party library (and say so), never to dodge a cycle.

``python tools/import_graph.py --list`` shows the same findings."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def graph(ig):
    return ig.read_graph()


def test_the_package_has_no_import_cycle(ig, graph):
    found = ig.cycles(graph.edges)
    assert not found, "import cycles (imports inside functions counted): " + "; ".join(" -> ".join(c) for c in found)


def test_every_import_points_down_a_floor(ig, graph):
    up = ig.upward(graph.edges, ig.LAYERS)
    assert not up, "imports to the same floor or a higher one (move the definition down, or hand it in): " + "; ".join(
        f"{a} -> {b}" for a, b in up)


def test_every_module_stands_on_a_floor(ig, graph):
    loose = ig.unplaced(graph.edges, ig.LAYERS)
    assert not loose, f"modules on no floor of tools/import_graph.py::FLOORS: {loose}"


def test_internal_imports_inside_functions_defer_a_slow_library_and_say_so(ig, graph):
    lazy = ig.undeferred(graph)
    assert not lazy, "imports inside functions that defer nothing slow (import at module level): " + "; ".join(
        f"{m}:{line} -> {t}" for m, line, t in lazy)
    silent = ig.unexplained(graph)
    assert not silent, "imports inside functions without a '# deferred: ...' comment: " + "; ".join(
        f"{m}:{line}" for m, line, _ in silent)


def test_third_party_imports_inside_functions_defer_heavy_libraries_only(ig, graph):
    light = sorted({(m, line, t) for m, line, t in graph.local_third_party if t not in ig.HEAVY})
    allowed = {"importlib", "tempfile", "traceback", "subprocess", "multiprocessing", "inspect", "shutil",
               "socket", "signal", "platform", "ctypes", "resource", "getpass", "gc", "tracemalloc", "random"}
    odd = [f"{m}:{line} imports {t}" for m, line, t in light if t not in allowed]
    assert not odd, "imports inside functions of libraries that cost nothing to import at the top: " + "; ".join(odd)


def test_cycle_finder_catches_a_cycle_through_an_import_inside_a_function(ig, tmp_path):
    """Negative control: a loop closed by a function-local import is a cycle."""
    pkg = tmp_path / "disttrain_ds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n    return g\n")
    found = ig.read_graph(pkg)
    assert ig.cycles(found.edges) == [["disttrain_ds.a", "disttrain_ds.b"]]
    assert found.local == [("disttrain_ds.b", 2, "disttrain_ds.a")]


def test_upward_imports_are_found_from_a_layer_map(ig):
    edges = {"p.low": {"p.high"}, "p.high": {"p.low"}}
    assert ig.upward(edges, {"p.low": 1, "p.high": 2}) == [("p.low", "p.high")]


def test_an_import_between_folders_of_one_floor_is_not_down(ig):
    edges = {"p.a.x": {"p.b.y"}, "p.b.y": set()}
    assert ig.upward(edges, {"p.a": 1, "p.b": 1}) == [("p.a.x", "p.b.y")]
    assert ig.upward(edges, {"p.a": 2, "p.b": 1}) == []


def test_an_import_inside_a_function_that_defers_nothing_slow_is_found(ig, tmp_path):
    """Negative control: a function-local import of a light module is flagged; one of a module
    that loads torch, with its comment, is not."""
    pkg = tmp_path / "disttrain_ds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "light.py").write_text("X = 1\n")
    (pkg / "heavy.py").write_text("import torch\n")
    (pkg / "user.py").write_text("def f():\n    from .light import X\n    return X\n\n\n"
                                 "def g():\n    # deferred: loads torch\n    from . import heavy\n    return heavy\n")
    found = ig.read_graph(pkg)
    assert ig.undeferred(found) == [("disttrain_ds.user", 2, "disttrain_ds.light")]
    assert ig.unexplained(found) == [("disttrain_ds.user", 2, "disttrain_ds.light")]

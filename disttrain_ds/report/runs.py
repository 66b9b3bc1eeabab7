"""Run directories as the report reads them: ``metrics.jsonl`` rows and the recipe's layout.

Every problem with the input is a one-line ``ReportError`` naming the file (and line).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from disttrain_ds.graph import MODULES


def module_names(runs: list["Run"], prefix: str = "time/", suffix: str = "_compute") -> list[str]:
    """Module names the runs log ``<prefix><name><suffix>`` for, in first-seen order (the three
    module names first, in their order, when present)."""
    seen: dict[str, None] = {}
    for run in runs:
        for record in run.records:
            for key in record:
                if key.startswith(prefix) and key.endswith(suffix) and len(key) > len(prefix) + len(suffix):
                    seen.setdefault(key[len(prefix):len(key) - len(suffix)])  # suffix may be empty
    return [m for m in MODULES if m in seen] + [m for m in seen if m not in MODULES]


class ReportError(Exception):
    """Bad input; reported as one line with exit code 2."""


@dataclass
class Run:
    """One run directory, loaded."""

    path: Path
    """The run directory."""
    layout: str
    """``layout`` from recipe.yaml; "?" when the run has no recipe.yaml."""
    records: list[dict]
    """metrics.jsonl rows in file order (one per optimizer step)."""
    name: str = ""
    """Short unique name: the directory name, or the whole path when two runs share it."""
    label: str = ""
    """Legend label: name and layout."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and finite numeric values of ``key`` (rows without it are skipped)."""
        pairs = [(r["step"], float(r[key])) for r in self.records if is_number(r.get(key))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def has(self, key: str) -> bool:
        return any(is_number(r.get(key)) for r in self.records)

    def median(self, key: str) -> float | None:
        values = self.series(key)[1]
        return statistics.median(values) if values else None


def is_number(value: object) -> bool:
    """A finite int or float (not a bool): a value worth plotting."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl; ReportError naming the file (and line) when it is unusable."""
    if not path.is_file():
        raise ReportError(f"{path}: no such file (is this a run directory?)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read ({exc})") from None
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):
                # A run killed mid-write leaves half a line: report what is complete.
                print(f"warning: {path}: ignoring incomplete last line {n}", file=sys.stderr)
                continue
            raise ReportError(f"{path}: line {n} is not valid JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or not is_number(row.get("loss")):
            raise ReportError(f"{path}: line {n} is not a step record "
                              "(needs integer 'step' and numeric 'loss')")
        rows.append(row)
    if not rows:
        raise ReportError(f"{path}: empty, no step records")
    return rows


def read_layout(run_dir: Path) -> str:
    path = run_dir / "recipe.yaml"
    if not path.is_file():
        return "?"
    import yaml

    try:
        recipe = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        raise ReportError(f"{path}: not valid YAML") from None
    return str(recipe.get("layout", "?")) if isinstance(recipe, dict) else "?"


def load_runs(dirs: list[str]) -> list[Run]:
    runs = []
    for d in dirs:
        path = Path(d)
        if not path.is_dir():
            raise ReportError(f"{path}: no such directory")
        runs.append(Run(path, read_layout(path), read_metrics(path / "metrics.jsonl")))
    names = [r.path.name for r in runs]
    for r in runs:  # same directory names under different parents: fall back to the path
        r.name = r.path.name if names.count(r.path.name) == 1 else str(r.path)
        r.label = f"{r.name} ({r.layout})"
    return runs

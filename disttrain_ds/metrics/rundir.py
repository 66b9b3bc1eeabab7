"""Run directories and the per-step ``metrics.jsonl`` record."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from disttrain_ds.recipe.graph import as_written


def make_run_dir(requested: str, name: str) -> Path:
    """Create a fresh run directory; an existing non-empty one is never reused.

    If the requested directory already holds files, a numbered sibling (``-2``, ``-3`` ...) is
    used instead and the caller prints where results go.
    """
    base = Path(requested) if requested else Path("runs") / name
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


def reopen_run_dir(path: Path, step: int) -> tuple[Path, int]:
    """Continue a run directory after resuming from ``step``: ``metrics.jsonl`` keeps the records
    up to ``step``; later ones (written after the checkpoint, before the stop) are moved to
    ``metrics.rolled_back.jsonl`` rather than lost. Returns the directory and the records moved."""
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        path.mkdir(parents=True, exist_ok=True)
        return path, 0
    keep, moved = [], []
    for line in metrics.read_text().splitlines():
        try:
            ok = int(json.loads(line)["step"]) <= step
        except (ValueError, KeyError, TypeError):
            ok = False  # a line cut short by the stop
        (keep if ok else moved).append(line)
    if moved:
        with (path / "metrics.rolled_back.jsonl").open("a") as f:
            f.write("".join(m + "\n" for m in moved))
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        tmp.replace(metrics)
    return path, len(moved)


def write_resolved_recipe(run_dir: Path, recipe, extra: dict | None = None, name: str = "recipe.yaml") -> None:
    data = as_written(recipe)
    if extra:
        data["resolved"] = extra
    (run_dir / name).write_text(yaml.safe_dump(data, sort_keys=False))


class MetricsWriter:
    """Appends one JSON object per optimizer step to ``metrics.jsonl`` (flushed each line)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._f = self.path.open("a")

    def write(self, record: dict) -> None:
        record = {"time": time.time(), **record}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def progress_line(rec: dict) -> str:
    parts = [f"step {rec['step']:>4}", f"loss {rec['loss']:.4f}"]
    for k in ("loss/lm", "loss/gen"):
        if k in rec:
            parts.append(f"{k.split('/')[1]} {rec[k]:.4f}")
    if "eval/loss" in rec:
        parts.append(f"eval {rec['eval/loss']:.4f}")
    parts.append(f"{rec['step_seconds']:.2f} s/step")
    parts.append(f"{rec['samples_per_s']:.2f} samples/s")
    parts.append(f"{rec['tokens_per_s']:.0f} tokens/s")
    if "perf/mfu/overall" in rec:
        parts.append(f"MFU {100 * rec['perf/mfu/overall']:.1f}%")
    return "  ".join(parts)

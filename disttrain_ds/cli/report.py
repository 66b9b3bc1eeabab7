"""Offline dashboard for training runs: PNG plots and a summary table from metrics.jsonl.

    disttrain-report runs/tiny_cpu
    disttrain-report runs/monolithic runs/disaggregated --html
    disttrain-report runs/a runs/b --out reports/a_vs_b

(``python tools/report.py ...`` in a checkout is the same command.) Several runs share each
figure (legend: run directory and layout). Writes into --out
(default <first run dir>/report/; a numbered sibling such as report-2 when that one is not
empty, so nothing is overwritten): loss.png (with a validation-loss panel when a run logged
eval/loss), step_time.png, mfu.png and balance.png (when
the runs log those keys), trace_<run>.json and gantt_<run>.png for runs with trace/*.json,
and index.html with --html. Bad input: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from ..metrics.logger import merge_chrome_traces
from ..runtime.rundir import make_run_dir

MODULES = ("encoder", "llm", "generator")
"""The three-module model's module names; other graphs' names are read from the metrics."""


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
MAX_GANTT_EVENTS = 4000  # beyond this a Gantt is unreadable and slow to draw
# Per-rank trace names -> the names the Gantt helper colours.
_GANTT_NAMES = {"forward": "fwd", "backward": "bwd"}


def _style(k: int) -> dict:
    """Colour and dash of run ``k``: equal curves (same losses in every layout) stay visible."""
    return {"color": f"C{k}", "linestyle": ("-", "--", ":", "-.")[k % 4]}


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
        pairs = [(r["step"], float(r[key])) for r in self.records if _number(r.get(key))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def has(self, key: str) -> bool:
        return any(_number(r.get(key)) for r in self.records)

    def median(self, key: str) -> float | None:
        values = self.series(key)[1]
        return statistics.median(values) if values else None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------- input


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
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or not _number(row.get("loss")):
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


# --------------------------------------------------------------------------- figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def loss_panels(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(title, keys) of each loss panel: total, LM and generation loss, and beside them the
    validation loss (``eval/loss`` and its per-module parts) when any run logged it."""
    panels = [("total loss", ["loss"]), ("LM loss", ["loss/lm"]), ("generation loss", ["loss/gen"])]
    if any(r.has("eval/loss") for r in runs):
        parts = [f"eval/loss/{m}" for m in module_names(runs, "eval/loss/", "")
                 if any(r.has(f"eval/loss/{m}") for r in runs)]
        panels.append(("validation loss", ["eval/loss", *parts]))
    return panels


_EVAL_MARKERS = ("o", "s", "^", "v", "D")  # one per validation key, the run keeps its colour


def plot_loss(runs: list[Run], out: Path) -> Path:
    plt = _pyplot()
    panels = loss_panels(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, keys) in zip(axes, panels):
        for k, run in enumerate(runs):
            for j, key in enumerate(keys):
                if not run.has(key):
                    continue
                if len(keys) == 1:
                    ax.plot(*run.series(key), **_style(k), label=run.label)
                else:  # sparse points (every eval.every steps): marked, one marker per key
                    ax.plot(*run.series(key), **_style(k), marker=_EVAL_MARKERS[j % len(_EVAL_MARKERS)],
                            label=f"{run.label} {key}")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    axes[0].legend(fontsize=8)
    return _save(fig, out / "loss.png")


def plot_mfu(runs: list[Run], out: Path) -> Path | None:
    names = module_names(runs, "perf/mfu/", "")
    keys = [f"perf/mfu/{m}" for m in (*[n for n in names if n != "overall"], "overall")
            if any(r.has(f"perf/mfu/{m}") for r in runs)]
    if not keys:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for k, run in enumerate(runs):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, [100 * v for v in values], **_style(k), label=run.label)
        ax.set(title=f"MFU {key.rsplit('/', 1)[1]}", xlabel="step", ylabel="MFU (%)")
        ax.set_ylim(bottom=0)  # from zero, so runs and modules compare by eye
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, out / "mfu.png")


def plot_step_time(runs: list[Run], out: Path) -> Path:
    """Step seconds over steps; median compute vs comm wait per module; median step split."""
    modules = module_names(runs)
    per_module = bool(modules)
    split_keys = ["time/data_wait", "time/comm_wait", "time/bubble"]
    split = any(r.has("time/step") for r in runs)
    plt = _pyplot()
    ncols = 1 + per_module + split
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
    axes = list(axes[0])
    ax = axes.pop(0)
    for k, run in enumerate(runs):
        ax.plot(*run.series("step_seconds"), **_style(k), label=run.label)
    ax.set(title="step time", xlabel="step", ylabel="seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if per_module:  # one group per module, one stacked bar per run: compute + comm wait
        ax = axes.pop(0)
        width = 0.8 / len(runs)
        for k, run in enumerate(runs):
            if not any(run.has(f"time/{m}_compute") for m in modules):
                continue
            xs = [m + (k - (len(runs) - 1) / 2) * width for m in range(len(modules))]
            comp = [run.median(f"time/{m}_compute") or 0.0 for m in modules]
            wait = [run.median(f"time/{m}_comm_wait") or 0.0 for m in modules]
            ax.bar(xs, comp, width, color=f"C{k}", label=f"{run.label} compute")
            ax.bar(xs, wait, width, bottom=comp, color=f"C{k}", alpha=0.35, hatch="//",
                   label=f"{run.label} comm wait")
        ax.set_xticks(range(len(modules)), modules)
        ax.set(title="median time per module (compute + comm wait)", ylabel="seconds")
        ax.legend(fontsize=7)
    if split:  # one stacked bar per run: waits, bubble, and the rest of the step
        ax = axes.pop(0)
        names = [r.label for r in runs]
        bottom = [0.0] * len(runs)
        for j, key in enumerate(split_keys):
            vals = [r.median(key) or 0.0 for r in runs]
            ax.bar(names, vals, bottom=bottom, color=f"C{j + 4}", label=key.split("/")[1])
            bottom = [b + v for b, v in zip(bottom, vals)]
        rest = [max((r.median("time/step") or 0.0) - b, 0.0) for r, b in zip(runs, bottom)]
        ax.bar(names, rest, bottom=bottom, color="C7", label="rest of step")
        ax.set(title="median step breakdown", ylabel="seconds")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=8)
    return _save(fig, out / "step_time.png")


def plot_balance(runs: list[Run], out: Path) -> Path | None:
    mods = [m for m in module_names(runs, "balance/", "_load_mean") if any(r.has(f"balance/{m}_load_mean") for r in runs)]
    if not mods:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(mods), figsize=(7 * len(mods), 4), squeeze=False)
    for ax, m in zip(axes[0], mods):
        for k, run in enumerate(runs):
            steps, mean = run.series(f"balance/{m}_load_mean")
            lo, hi = run.series(f"balance/{m}_load_min")[1], run.series(f"balance/{m}_load_max")[1]
            if not steps:
                continue
            ax.plot(steps, mean, **_style(k), label=f"{run.label} mean")
            if len(lo) == len(hi) == len(steps):  # band from least to most loaded DP rank
                ax.fill_between(steps, lo, hi, color=f"C{k}", alpha=0.2, label=f"{run.label} min-max")
        ax.set(title=f"{m} load per DP rank", xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "balance.png")


def _gantt_event(e: dict, t0: float) -> dict:
    """A trace span (microseconds) as a timeline event in ms from ``t0``, one row per rank."""
    mb = (e.get("args") or {}).get("microbatch")
    return {"name": _GANTT_NAMES.get(e.get("name"), str(e.get("name"))), "stage": e["pid"],
            "microbatch": mb if isinstance(mb, int) else None,
            "start": (e["ts"] - t0) / 1e3, "end": (e["ts"] + e["dur"] - t0) / 1e3}


def plot_traces(run: Run, out: Path) -> list[Path]:
    """Merge ``trace/*.json`` of a run and draw its pipeline Gantt; a bad trace only warns."""
    from ..planner.timeline import write_gantt_png

    files = sorted((run.path / "trace").glob("*.json"))
    if not files:
        return []
    stem = run.name.replace("/", "_").replace("\\", "_")
    try:
        merged = merge_chrome_traces(files, out / f"trace_{stem}.json")
    except ValueError as exc:
        print(f"warning: {run.path}: no Gantt chart ({exc})", file=sys.stderr)
        return []
    events = json.loads(merged.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = sorted((e for e in events if e.get("ph") == "X" and _number(e.get("ts"))
                    and _number(e.get("dur")) and e["dur"] >= 0), key=lambda e: e["ts"])
    if not spans:
        return [merged]
    title = f"{run.label}: pipeline timeline"
    if len(spans) > MAX_GANTT_EVENTS:
        spans, title = spans[:MAX_GANTT_EVENTS], f"{title} (first {MAX_GANTT_EVENTS} events)"
    gantt = [_gantt_event(e, spans[0]["ts"]) for e in spans]
    png = write_gantt_png(gantt, out / f"gantt_{stem}.png", unit="ms", title=title, stage_names=names)
    return [merged, png]


# --------------------------------------------------------------------------- table, html


def summary_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    header = ["run", "layout", "steps", "final loss", "median s/step", "median samples/s"]
    mfu = any(r.has("perf/mfu/overall") for r in runs)
    if mfu:
        header.append("median MFU")
    evals = any(r.has("eval/loss") for r in runs)
    if evals:
        header.append("final eval loss")
    rows = []
    for r in runs:
        row = [r.name, r.layout, str(r.records[-1]["step"]), f"{r.records[-1]['loss']:.4f}",
               fmt(r.median("step_seconds"), ".3f"), fmt(r.median("samples_per_s"), ".2f")]
        if mfu:
            m = r.median("perf/mfu/overall")
            row.append("-" if m is None else f"{100 * m:.1f}%")
        if evals:
            row.append(fmt((r.series("eval/loss")[1] or [None])[-1], ".4f"))
        rows.append(row)
    return header, rows


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_html(runs: list[Run], header: list[str], rows: list[list[str]], pngs: list[Path], out: Path) -> Path:
    esc = html.escape
    table = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>\n" + "\n".join(
        "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    images = "\n".join(
        f'<h2>{esc(p.stem)}</h2>\n<img alt="{esc(p.name)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">' for p in pngs)
    sources = "".join(f"<li>{esc(r.label)}: <code>{esc(str(r.path.resolve()))}</code></li>" for r in runs)
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>disttrain-ds report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}</style>
</head><body><h1>disttrain-ds report</h1><ul>{sources}</ul>
<table>{table}</table>
{images}
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", help="output directory (default: <first run dir>/report)")
    parser.add_argument("--html", action="store_true", help="also write a self-contained index.html")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        runs = load_runs(args.run_dirs)
        requested = Path(args.out) if args.out else runs[0].path / "report"
        if requested.exists() and not requested.is_dir():
            raise ReportError(f"{requested}: exists and is not a directory")
        out = make_run_dir(str(requested), "report")  # never reuses a non-empty directory
        if out != requested:
            print(f"note: {requested} is not empty; writing to {out}", file=sys.stderr)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    pngs = [plot_loss(runs, out), plot_step_time(runs, out), plot_mfu(runs, out), plot_balance(runs, out)]
    pngs = [p for p in pngs if p is not None]
    traces = [p for run in runs for p in plot_traces(run, out)]
    pngs += [p for p in traces if p.suffix == ".png"]
    header, rows = summary_rows(runs)
    print(format_table(header, rows))
    written = pngs + [p for p in traces if p.suffix == ".json"]
    if args.html:
        written.append(write_html(runs, header, rows, pngs, out))
    print(f"\nreport: {out}")
    for p in written:
        print(f"  {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

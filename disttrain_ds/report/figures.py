"""The report's figures: loss, step time, MFU, load balance and per-run pipeline Gantt charts (PNG)."""

from __future__ import annotations

import sys
from pathlib import Path

from disttrain_ds.metrics.logger import merge_chrome_traces
from disttrain_ds.report.runs import Run, is_number, module_names
from disttrain_ds.schedule.timeline import read_trace_events, write_gantt_png

MAX_GANTT_EVENTS = 4000  # beyond this a Gantt is unreadable and slow to draw
# Per-rank trace names -> the names the Gantt helper colours.
_GANTT_NAMES = {"forward": "fwd", "backward": "bwd"}


def _style(k: int) -> dict:
    """Colour and dash of run ``k``: equal curves (same losses in every layout) stay visible."""
    return {"color": f"C{k}", "linestyle": ("-", "--", ":", "-.")[k % 4]}


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
    files = sorted((run.path / "trace").glob("*.json"))
    if not files:
        return []
    stem = run.name.replace("/", "_").replace("\\", "_")
    try:
        merged = merge_chrome_traces(files, out / f"trace_{stem}.json")
    except ValueError as exc:
        print(f"warning: {run.path}: no Gantt chart ({exc})", file=sys.stderr)
        return []
    events = read_trace_events(merged)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = sorted((e for e in events if e.get("ph") == "X" and is_number(e.get("ts"))
                    and is_number(e.get("dur")) and e["dur"] >= 0), key=lambda e: e["ts"])
    if not spans:
        return [merged]
    title = f"{run.label}: pipeline timeline"
    if len(spans) > MAX_GANTT_EVENTS:
        spans, title = spans[:MAX_GANTT_EVENTS], f"{title} (first {MAX_GANTT_EVENTS} events)"
    gantt = [_gantt_event(e, spans[0]["ts"]) for e in spans]
    png = write_gantt_png(gantt, out / f"gantt_{stem}.png", unit="ms", title=title, stage_names=names)
    return [merged, png]

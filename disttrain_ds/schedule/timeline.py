"""Pipeline timelines as Chrome-trace JSON (Perfetto / chrome://tracing) and Gantt PNGs.

Input events are the simulator's :class:`~disttrain_ds.schedule.simulate.Event` tuples or
dicts of the same shape recorded on real ranks: ``name`` (e.g. "fwd", "bwd", "allreduce"),
``stage``, optional ``microbatch`` and ``rank``, ``start`` and ``end`` (seconds or ms; say
which with ``unit``). Each stage becomes one track (a Chrome-trace process, named
"stage N", or by :func:`module_stage_names` after the module it belongs to); real events that
carry a ``rank`` get one thread per rank inside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from disttrain_ds.graph import ModuleGraph
from disttrain_ds.schedule.simulate import graph_stages

_UNIT_TO_US = {"s": 1e6, "ms": 1e3, "us": 1.0}
_COLOURS = {"fwd": "#4C72B0", "bwd": "#DD8452"}
_TRACE_COLOURS = {"fwd": "thread_state_running", "bwd": "thread_state_iowait"}


def normalize_events(events: Iterable[Any]) -> list[dict]:
    """Events as plain dicts with name/stage/microbatch/rank/start/end; validates them."""
    out = []
    for k, e in enumerate(events):
        d = e.to_dict() if hasattr(e, "to_dict") else dict(e) if isinstance(e, Mapping) else None
        if d is None:
            raise ValueError(f"events[{k}] must be a mapping or have to_dict(), "
                             f"got {type(e).__name__}")
        missing = {"name", "stage", "start", "end"} - d.keys()
        if missing:
            raise ValueError(f"events[{k}] lacks {sorted(missing)}")
        start, end = float(d["start"]), float(d["end"])
        if end < start:
            raise ValueError(f"events[{k}] ends ({end}) before it starts ({start})")
        out.append({"name": str(d["name"]), "stage": int(d["stage"]),
                    "microbatch": None if d.get("microbatch") is None else int(d["microbatch"]),
                    "rank": None if d.get("rank") is None else int(d["rank"]),
                    "start": start, "end": end})
    return out


def module_stage_names(graph: ModuleGraph, pp: Mapping[str, int]) -> dict[int, str]:
    """Track names ``"<module> stage <j>"`` for the stage numbers of
    :func:`~disttrain_ds.schedule.simulate.graph_stages` (modules in data-flow order), to pass as
    ``stage_names``; a module with one stage is just its name."""
    ranges, _ = graph_stages(graph, pp)
    return {s: name if len(r) == 1 else f"{name} stage {j}"
            for name, r in ranges.items() for j, s in enumerate(r)}


def _label(e: dict) -> str:
    return e["name"] if e["microbatch"] is None else f"{e['name']} {e['microbatch']}"


def trace_file(trace_events: list[dict]) -> dict:
    """The Chrome trace-event file around ``trace_events`` (``ts`` / ``dur`` in microseconds)."""
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_trace_events(trace_events: list[dict], path: str | Path) -> Path:
    """Write ``trace_events`` as one Chrome trace file (every trace this package writes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_file(trace_events)))
    return path


def read_trace_events(path: str | Path) -> list[dict]:
    """The events of a Chrome trace file, in either layout (``{"traceEvents": [...]}`` or a bare
    list); ValueError naming the file if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON trace ({' '.join(str(exc).split())})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{path}: expected a list of trace events or {{'traceEvents': [...]}}")
    return events


def to_chrome_trace(events: Iterable[Any], unit: str = "ms",
                    stage_names: Mapping[int, str] | None = None) -> dict:
    """Chrome trace-event JSON object: one complete ("X") event per op, one process per stage."""
    if unit not in _UNIT_TO_US:
        raise ValueError(f"unit must be one of {sorted(_UNIT_TO_US)}, got {unit!r}")
    scale = _UNIT_TO_US[unit]
    evs = normalize_events(events)
    trace: list[dict] = []
    for stage in sorted({e["stage"] for e in evs}):
        name = (stage_names or {}).get(stage, f"stage {stage}")
        trace.append({"name": "process_name", "ph": "M", "pid": stage, "tid": 0,
                      "args": {"name": name}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": stage, "tid": 0,
                      "args": {"sort_index": stage}})
    for e in evs:
        ev = {"name": _label(e), "cat": e["name"], "ph": "X", "pid": e["stage"],
              "tid": e["rank"] or 0, "ts": e["start"] * scale,
              "dur": (e["end"] - e["start"]) * scale,
              "args": {"microbatch": e["microbatch"], "stage": e["stage"]}}
        if e["name"] in _TRACE_COLOURS:
            ev["cname"] = _TRACE_COLOURS[e["name"]]
        trace.append(ev)
    return trace_file(trace)


def write_chrome_trace(events: Iterable[Any], path: str | Path, unit: str = "ms",
                       stage_names: Mapping[int, str] | None = None) -> Path:
    """Write :func:`to_chrome_trace` to ``path`` (open it in ui.perfetto.dev)."""
    return write_trace_events(to_chrome_trace(events, unit, stage_names)["traceEvents"], path)


def write_gantt_png(events: Iterable[Any], path: str | Path, unit: str = "ms",
                    title: str = "", stage_names: Mapping[int, str] | None = None,
                    label_microbatches: bool = True) -> Path:
    """Gantt chart, one row per stage (stage 0 on top), forwards and backwards coloured."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training hosts
    import matplotlib.pyplot as plt

    evs = normalize_events(events)
    if not evs:
        raise ValueError("events must not be empty")
    stages = sorted({e["stage"] for e in evs})
    row = {s: k for k, s in enumerate(stages)}
    span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(stages) + 1.5))
    try:
        for e in evs:
            width = e["end"] - e["start"]
            y = len(stages) - 1 - row[e["stage"]]
            ax.barh(y, width, left=e["start"], height=0.8, edgecolor="black", linewidth=0.3,
                    color=_COLOURS.get(e["name"], "#8C8C8C"))
            # Label only boxes wide enough to hold text.
            if label_microbatches and e["microbatch"] is not None and width > span / 80:
                ax.text(e["start"] + width / 2, y, str(e["microbatch"]), ha="center",
                        va="center", fontsize=6)
        ax.set_yticks(range(len(stages)))
        ax.set_yticklabels([(stage_names or {}).get(s, f"stage {s}") for s in reversed(stages)])
        ax.set_xlabel(f"time ({unit})")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
        ax.legend(handles, list(_COLOURS), loc="upper right", fontsize=7)
        if title:
            ax.set_title(title)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path

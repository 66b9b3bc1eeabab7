"""Timeline export: Chrome trace JSON structure and Gantt PNG output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from disttrain_ds.schedule.simulate import simulate_1f1b
from disttrain_ds.schedule.timeline import normalize_events, to_chrome_trace, write_chrome_trace, write_gantt_png


@pytest.fixture()
def sim_events():
    fwd = np.array([[1.0, 2.0, 1.0], [0.5, 1.0, 0.5], [2.0, 1.0, 1.5]])
    return simulate_1f1b(fwd, 2 * fwd).events


def test_chrome_trace_is_valid_and_has_one_track_per_stage(tmp_path, sim_events):
    path = write_chrome_trace(sim_events, tmp_path / "trace.json", unit="ms")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(sim_events)
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
        assert isinstance(e["ts"], float) and e["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    # ms -> us, the trace format's unit
    first = min(complete, key=lambda e: e["ts"])
    src = min(sim_events, key=lambda e: e.start)
    assert first["ts"] == pytest.approx(src.start * 1e3)
    assert first["dur"] == pytest.approx((src.end - src.start) * 1e3)


def test_chrome_trace_accepts_real_rank_dicts_in_seconds():
    evs = [{"name": "fwd", "stage": 1, "microbatch": 0, "rank": 3, "start": 0.5, "end": 0.75},
           {"name": "allreduce", "stage": 1, "start": 1.0, "end": 1.5}]
    trace = to_chrome_trace(evs, unit="s")["traceEvents"]
    x = [e for e in trace if e["ph"] == "X"]
    assert x[0]["tid"] == 3 and x[0]["ts"] == pytest.approx(5e5) and x[0]["name"] == "fwd 0"
    assert x[1]["name"] == "allreduce" and x[1]["dur"] == pytest.approx(5e5)


def test_invalid_events_are_rejected():
    with pytest.raises(ValueError, match="lacks"):
        normalize_events([{"name": "fwd", "start": 0, "end": 1}])
    with pytest.raises(ValueError, match="before it starts"):
        normalize_events([{"name": "fwd", "stage": 0, "start": 2, "end": 1}])
    with pytest.raises(ValueError, match="unit"):
        to_chrome_trace([], unit="minutes")


def test_gantt_png_is_written(tmp_path, sim_events):
    path = write_gantt_png(sim_events, tmp_path / "sub" / "gantt.png", title="1F1B")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_module_stage_names_label_the_tracks_of_a_module_graph():
    from disttrain_ds.graph import ModuleGraph
    from disttrain_ds.schedule.simulate import graph_stages, simulate_dag
    from disttrain_ds.schedule.timeline import module_stage_names

    graph = ModuleGraph.from_roles({"vit": "encoder", "audio": "encoder", "llm": "llm",
                                    "sd": "generator"})
    pp = {"vit": 1, "audio": 2, "llm": 2, "sd": 1}
    names = module_stage_names(graph, pp)
    assert names == {0: "vit", 1: "audio stage 0", 2: "audio stage 1", 3: "llm stage 0",
                     4: "llm stage 1", 5: "sd"}
    _, preds = graph_stages(graph, pp)
    events = simulate_dag(np.ones((3, 6)), 2 * np.ones((3, 6)), preds).events
    trace = to_chrome_trace(events, stage_names=names)
    tracks = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
              if e["name"] == "process_name"}
    assert tracks == names

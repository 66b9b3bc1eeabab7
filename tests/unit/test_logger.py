"""RunLogger (metrics.jsonl, wandb, progress bar), wandb degradation, Chrome-trace merging and
the wandb workspace definition."""

from __future__ import annotations

import io
import json
import sys
import time
import types

import pytest

from disttrain_ds.metrics.logger import LoggerOptions, RunLogger, merge_chrome_traces, resolve_wandb_mode, wandb_payload
from disttrain_ds.metrics.wandb_workspace import DASHBOARD, apply_workspace, dashboard_keys

STEP1 = {"step": 1, "loss": 6.5, "loss/lm": 5.5, "loss/gen": 1.0, "step_seconds": 0.5,
         "samples_per_s": 8.0, "tokens_per_s": 600.0, "lr": 1e-3,
         "time/llm_compute": 0.3, "time/llm_comm_wait": 0.1, "perf/mfu/overall": 0.3,
         "balance/encoder_load_max": 120, "memory/llm_peak_gib": 1.5}
STEP2 = {**STEP1, "step": 2, "loss": 6.0}


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class FakeWandb(types.ModuleType):
    """Stands in for the wandb module: records init kwargs, log calls and finish codes."""

    def __init__(self, init_error: Exception | None = None, log_error_at: int | None = None):
        super().__init__("wandb")
        self.init_kwargs: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished: list[int] = []
        self._init_error, self._log_error_at = init_error, log_error_at

    def init(self, **kwargs):
        if self._init_error:
            raise self._init_error
        self.init_kwargs.append(kwargs)
        fake = self

        class Run:
            def log(self, payload, step):
                if step == fake._log_error_at:
                    raise ConnectionError("wandb service went away")
                fake.logged.append((step, payload))

            def finish(self, exit_code=0):
                fake.finished.append(exit_code)

        return Run()


@pytest.fixture()
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return fake


def test_jsonl_gets_one_row_per_step_with_keys_as_given(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with RunLogger(tmp_path, LoggerOptions(progress=False)) as logger:
        logger.log(STEP1)
        logger.log(STEP2)
        assert logger.wandb_run is None
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert {k: rows[0][k] for k in STEP1} == STEP1  # namespaced keys untouched
    assert isinstance(rows[0]["time"], float)  # MetricsWriter's unix timestamp
    assert not (tmp_path / "wandb").exists()  # disabled means no wandb files at all


def test_wandb_payload_adds_loss_total_and_skips_step_time_and_non_numbers():
    payload = wandb_payload({**STEP1, "time": 1.7e9, "note": "warmup", "flag": True})
    assert payload["loss/total"] == payload["loss"] == 6.5
    assert payload["perf/mfu/overall"] == 0.3 and payload["time/llm_compute"] == 0.3
    assert not {"step", "time", "note", "flag"} & payload.keys()


def test_records_reach_wandb_at_their_step_with_recipe_config(tmp_path, fake_wandb, tiny_recipe):
    resolved = {"world_size": 4, "topology": "encoder: dp 1 pp 1"}
    logger = RunLogger.from_recipe(tmp_path, tiny_recipe, resolved=resolved, progress=False)
    logger.log(STEP1)
    logger.log(STEP2)
    logger.close()
    logger.close()  # second close is a no-op
    (kwargs,) = fake_wandb.init_kwargs
    assert kwargs["project"] == tiny_recipe.logging.project and kwargs["name"] == tiny_recipe.name
    assert kwargs["dir"] == str(tmp_path) and kwargs["mode"] == "offline"
    assert kwargs["config"]["resolved"] == resolved
    assert kwargs["config"]["layout"] == tiny_recipe.layout
    assert [s for s, _ in fake_wandb.logged] == [1, 2]
    assert fake_wandb.logged[1][1]["loss/total"] == 6.0
    assert fake_wandb.finished == [0]


def test_exception_inside_context_marks_wandb_run_failed(tmp_path, fake_wandb):
    with pytest.raises(RuntimeError):
        with RunLogger(tmp_path, LoggerOptions(progress=False)) as logger:
            logger.log(STEP1)
            raise RuntimeError("rank died")
    assert fake_wandb.finished == [1]


def test_wandb_mode_env_var_overrides_recipe(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_wandb_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("online") == "disabled"
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # wandb's old name for offline
    assert resolve_wandb_mode("disabled") == "offline"
    warnings: list[str] = []
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    assert resolve_wandb_mode("online", warnings.append) == "disabled"
    assert len(warnings) == 1 and "sometimes" in warnings[0]
    with pytest.raises(ValueError, match="wandb mode"):
        resolve_wandb_mode("cloud")


def test_missing_wandb_package_degrades_to_jsonl_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.delenv("WANDB_MODE", raising=False)
    warnings: list[str] = []
    with RunLogger(tmp_path, LoggerOptions(progress=False), warn=warnings.append) as logger:
        logger.log(STEP1)
        logger.log(STEP2)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "wandb unavailable" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]


def test_wandb_init_error_degrades_to_jsonl_with_one_line_warning(tmp_path, monkeypatch):
    fake = FakeWandb(init_error=RuntimeError("no network\n  long details\n  more"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "online")
    warnings: list[str] = []
    with RunLogger(tmp_path, LoggerOptions(progress=False), warn=warnings.append) as logger:
        logger.log(STEP1)
    assert warnings == [f"warning: wandb unavailable (RuntimeError: no network); "
                        f"logging to {tmp_path / 'metrics.jsonl'} only"]
    assert len(_rows(tmp_path)) == 1


def test_wandb_log_error_mid_run_stops_wandb_but_not_jsonl(tmp_path, monkeypatch):
    fake = FakeWandb(log_error_at=2)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    warnings: list[str] = []
    with RunLogger(tmp_path, LoggerOptions(progress=False), warn=warnings.append) as logger:
        for s in (1, 2, 3):
            logger.log({**STEP1, "step": s})
    assert [s for s, _ in fake.logged] == [1]
    assert fake.finished == [1] and len(warnings) == 1 and "from step 2" in warnings[0]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]


def test_progress_bar_only_on_a_terminal_and_shows_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with RunLogger(tmp_path / "a", LoggerOptions(total_steps=2)) as logger:
        assert logger.bar is None  # pytest's captured stderr is no terminal

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    with RunLogger(tmp_path / "b", LoggerOptions(total_steps=2, progress=False)) as logger:
        assert logger.bar is None  # asked for no bar
    with RunLogger(tmp_path / "c", LoggerOptions(total_steps=2)) as logger:
        logger.log(STEP1)
        assert logger.bar.n == 1
        assert "MFU=30.0%" in logger.bar.postfix and "loss=6.5000" in logger.bar.postfix


def test_offline_wandb_run_lives_under_run_dir(tmp_path, monkeypatch, tiny_recipe):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    run_dir = tmp_path / "run"
    resolved = {"world_size": 4, "topology": "llm pp 2 marker-xyz"}
    with RunLogger.from_recipe(run_dir, tiny_recipe, resolved=resolved, progress=False) as logger:
        assert logger.wandb_run is not None, "offline wandb run did not start"
        logger.log(STEP1)
        logger.log(STEP2)
    (store,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wanted = [b"loss/total", b"perf/mfu/overall", b"marker-xyz"]  # history and config
    deadline = time.monotonic() + 15
    # wandb's service process may still be writing the file when finish() returns.
    while not all(w in store.read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [w for w in wanted if w not in store.read_bytes()] == []
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert len(_rows(run_dir)) == 2


def _write_trace(path, events, wrap=True) -> None:
    path.write_text(json.dumps({"traceEvents": events} if wrap else events))


def test_merged_trace_has_one_track_per_rank_with_names_kept(tmp_path):
    ev = lambda name, ts, pid, tid=0: {"name": name, "ph": "X", "ts": ts, "dur": 5.0,  # noqa: E731
                                       "pid": pid, "tid": tid, "args": {"microbatch": 0}}
    _write_trace(tmp_path / "rank0.json", [
        {"name": "process_name", "ph": "M", "pid": 4242, "args": {"name": "encoder stage 0"}},
        ev("forward", 10.0, 4242), ev("send", 15.0, 4242, tid=1)])
    _write_trace(tmp_path / "rank1.json", [ev("recv", 12.0, 4242), ev("backward", 30.0, 4242)],
                 wrap=False)  # bare-list traces are valid too; same OS pid as rank 0
    _write_trace(tmp_path / "rank10.json", [ev("wait", 1.0, 7)])
    files = [tmp_path / "rank10.json", tmp_path / "rank1.json", tmp_path / "rank0.json"]
    out = merge_chrome_traces(files, tmp_path / "merged" / "trace.json")
    events = json.loads(out.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in spans) == [
        (0, "forward"), (0, "send"), (1, "backward"), (1, "recv"), (10, "wait")]
    assert {e["name"]: e["tid"] for e in spans}["send"] == 1
    assert {e["name"]: e["ts"] for e in spans}["backward"] == 30.0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "encoder stage 0", 1: "rank 1", 10: "rank 10"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert order == {0: 0, 1: 1, 10: 10}


def test_merge_rejects_corrupt_and_duplicate_rank_files_by_name(tmp_path):
    (tmp_path / "rank0.json").write_text("{not json")
    with pytest.raises(ValueError, match="rank0.json"):
        merge_chrome_traces([tmp_path / "rank0.json"], tmp_path / "out.json")
    (tmp_path / "a").mkdir()
    _write_trace(tmp_path / "a" / "rank1.json", [])
    _write_trace(tmp_path / "rank1.json", [])
    with pytest.raises(ValueError, match="both rank 1"):
        merge_chrome_traces([tmp_path / "rank1.json", tmp_path / "a" / "rank1.json"], tmp_path / "o.json")
    with pytest.raises(ValueError, match="no trace files"):
        merge_chrome_traces([], tmp_path / "o.json")


def test_dashboard_covers_losses_mfu_time_and_balance():
    keys = dashboard_keys()
    assert {"loss/total", "loss/lm", "loss/gen", "perf/mfu/overall", "time/bubble",
            "time/generator_comm_wait", "balance/encoder_load_max"} <= set(keys)
    assert len(keys) == len(set(keys)) and all(p.keys for s in DASHBOARD for p in s.panels)


def test_workspace_is_not_saved_while_wandb_is_offline(monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert apply_workspace("disttrain-ds") is None
    assert "not saved" in capsys.readouterr().err


def test_dashboard_of_a_module_graph_plots_its_module_names():
    from disttrain_ds.metrics.wandb_workspace import dashboard

    keys = dashboard_keys(dashboard(("vision", "llm"), ("vision",), ("llm",)))
    assert "perf/mfu/vision" in keys and "time/vision_compute" in keys and "balance/vision_load_max" in keys
    assert not any("encoder" in k or "generator" in k for k in keys)


def test_an_online_run_saves_its_graphs_own_dashboard_and_an_offline_one_saves_none(tmp_path, fake_wandb, monkeypatch):
    from disttrain_ds.recipe.schema import load_recipe

    saved = []
    monkeypatch.setattr("disttrain_ds.metrics.logger.apply_workspace",
                        lambda project, entity=None, name="", sections=(): saved.append((project, name, sections)) or "url")
    vlm = load_recipe("tiny_vlm")  # vision -> llm, no generator
    RunLogger.from_recipe(tmp_path / "offline", vlm, progress=False).close()
    assert saved == []  # offline: no project to save it to, and no network
    out = io.StringIO()
    RunLogger.from_recipe(tmp_path / "online", load_recipe("tiny_vlm", ["logging.wandb=online"]),
                          progress=False, out=out).close()
    ((project, name, sections),) = saved
    keys = dashboard_keys(sections)
    assert project == vlm.logging.project and name == "disttrain-ds: vision llm" and "dashboard url" in out.getvalue()
    assert {"perf/mfu/vision", "time/vision_compute", "balance/vision_load_max", "perf/mfu/llm"} <= set(keys)
    assert not any("encoder" in k or "generator" in k or k == "loss/gen" for k in keys)


def test_graph_dashboard_of_the_three_module_graph_is_the_default_dashboard():
    from disttrain_ds.graph import ModuleGraph
    from disttrain_ds.metrics.wandb_workspace import graph_dashboard

    assert graph_dashboard(ModuleGraph.default()) == DASHBOARD
    t2i = dashboard_keys(graph_dashboard(ModuleGraph.from_roles({"llm": "llm", "painter": "generator"})))
    assert "loss/gen" in t2i and "balance/painter_load_max" in t2i and "balance/llm_load_max" not in t2i


@pytest.mark.parametrize("name", ["tiny_cpu", "tiny_vlm"])
def test_graph_dashboard_plots_the_validation_loss_keys_the_runtime_logs(name):
    from types import SimpleNamespace

    from disttrain_ds.metrics.wandb_workspace import graph_dashboard
    from disttrain_ds.recipe.graph import graph_of
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.callbacks.evaluation import eval_figures

    graph = graph_of(load_recipe(name))
    spec = SimpleNamespace(name_of={"llm": graph.llm}.get, generators=graph.generators)
    logged = set(wandb_payload(eval_figures(4.0, dict.fromkeys(graph.generators, 0.5), spec)))
    (panel,) = [p for s in graph_dashboard(graph) for p in s.panels if p.title == "validation loss"]
    assert set(panel.keys) == logged and panel.keys[0] == "eval/loss"
    assert len(logged) == (3 if graph.generators else 2)

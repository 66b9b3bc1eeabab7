"""tools/report.py end to end on fake run directories: figures, table, html, traces, errors."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPORT = Path(__file__).resolve().parents[2] / "tools" / "report.py"
MODULES = ("encoder", "llm", "generator")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_record(step: int, disaggregated: bool) -> dict:
    """One plausible metrics.jsonl row; the disaggregated run also has MFU, splits and balance."""
    secs = 2.0 if step == 1 else 0.5 if disaggregated else 1.0  # step 1 is warm-up
    rec = {"step": step, "loss": 6.0 - 0.25 * step, "loss/lm": 5.0 - 0.2 * step,
           "loss/gen": 1.0 - 0.05 * step, "step_seconds": secs, "samples_per_s": 4 / secs,
           "tokens_per_s": 512 / secs, "lr": 1e-3, "time": 1.7e9 + step}
    for k, m in enumerate(MODULES):
        rec[f"time/{m}_compute"] = 0.1 * (k + 1)
        rec[f"time/{m}_comm_wait"] = 0.05 * (3 - k)
    if disaggregated:
        for m, mfu in zip((*MODULES, "overall"), (0.2, 0.4, 0.25, 0.3)):
            rec[f"perf/mfu/{m}"] = mfu
            rec[f"perf/tflops_per_gpu/{m}"] = mfu * 989
        rec.update({"time/step": secs, "time/data_wait": 0.02, "time/comm_wait": 0.1,
                    "time/bubble": 0.08, "memory/llm_peak_gib": 3.5})
        for m in ("encoder", "generator"):
            rec.update({f"balance/{m}_load_max": 130 + step, f"balance/{m}_load_min": 90,
                        f"balance/{m}_load_mean": 110})
    return rec


def make_run(root: Path, name: str, layout: str, steps: int = 6, traces: bool = False) -> Path:
    run = root / name
    run.mkdir(parents=True)
    disagg = layout == "disaggregated"
    (run / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "tiny_cpu", "layout": layout,
        "resolved": {"world_size": 4, "topology": "encoder 1 + llm pp 2 + generator 1"}}))
    rows = [json.dumps(fake_record(s, disagg)) for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    if traces:
        (run / "trace").mkdir()
        for rank in range(4):
            events = [{"name": "process_name", "ph": "M", "pid": 100 + rank,
                       "args": {"name": f"rank {rank} ({MODULES[min(rank, 2)]})"}}]
            for mb in range(3):
                t = 1000.0 * (rank + 2 * mb)
                events += [{"name": n, "ph": "X", "pid": 100 + rank, "tid": 0, "ts": t + off,
                            "dur": 400.0, "args": {"microbatch": mb}}
                           for n, off in (("forward", 0), ("send", 450), ("backward", 6000))]
            (run / "trace" / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    return run


def run_report(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """One report over a monolithic and a disaggregated run (the latter with traces)."""
    root = tmp_path_factory.mktemp("runs")
    mono = make_run(root, "mono", "monolithic")
    disagg = make_run(root, "disagg", "disaggregated", traces=True)
    proc = run_report(mono, disagg, "--html")
    assert proc.returncode == 0, proc.stderr
    return proc, mono / "report"


def test_report_defaults_to_first_run_dir_and_draws_every_figure(side_by_side):
    _, out = side_by_side
    for name in ("loss.png", "step_time.png", "mfu.png", "balance.png", "gantt_disagg.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


def test_summary_table_has_final_loss_median_step_time_and_mfu(side_by_side):
    proc, _ = side_by_side
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["run", "layout", "steps", "final", "loss", "median", "s/step",
                                "median", "samples/s", "median", "MFU"]
    # Medians skip past the 2 s warm-up step; MFU is shown only where logged.
    assert lines[2].split() == ["mono", "monolithic", "6", "4.5000", "1.000", "4.00", "-"]
    assert lines[3].split() == ["disagg", "disaggregated", "6", "4.5000", "0.500", "8.00", "30.0%"]


def test_html_is_one_self_contained_page_with_table_and_all_pngs(side_by_side):
    _, out = side_by_side
    page = (out / "index.html").read_text()
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == len(list(out.glob("*.png"))) == 5
    prefix = "data:image/png;base64,"
    assert all(s.startswith(prefix) for s in sources)  # nothing linked, all embedded
    assert base64.b64decode(sources[0][len(prefix):])[:8] == PNG_MAGIC
    assert "<td>disaggregated</td>" in page and "<td>30.0%</td>" in page


def test_rank_traces_are_merged_into_one_perfetto_file(side_by_side):
    _, out = side_by_side
    events = json.loads((out / "trace_disagg.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4 * 3 * 3 and {e["pid"] for e in spans} == {0, 1, 2, 3}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[3] == "rank 3 (generator)"


def test_existing_report_is_never_overwritten(tmp_path):
    run = make_run(tmp_path, "solo", "reference", steps=3)
    first = run_report(run)
    assert first.returncode == 0, first.stderr
    stamp = (run / "report" / "loss.png").stat().st_mtime_ns
    second = run_report(run)
    assert second.returncode == 0, second.stderr
    assert (run / "report-2" / "loss.png").is_file()
    assert (run / "report" / "loss.png").stat().st_mtime_ns == stamp
    assert "report-2" in second.stdout and "not empty" in second.stderr


def test_incomplete_last_line_of_a_live_run_is_skipped_with_a_warning(tmp_path):
    run = make_run(tmp_path, "live", "reference", steps=4)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 4.')  # writer killed mid-line
    proc = run_report(run, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "incomplete last line 5" in proc.stderr
    assert proc.stdout.splitlines()[2].split()[:3] == ["live", "reference", "4"]


def test_unreadable_trace_only_drops_the_gantt_chart(tmp_path):
    run = make_run(tmp_path, "traced", "disaggregated", traces=True)
    (run / "trace" / "rank2.json").write_text("{truncated")
    proc = run_report(run, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "rank2.json" in proc.stderr and "warning" in proc.stderr
    assert (tmp_path / "out" / "loss.png").is_file()
    assert not (tmp_path / "out" / "gantt_traced.png").exists()


def _break(kind: str, tmp_path: Path) -> tuple[list, str]:
    """A bad input of ``kind``: (report arguments, text the error line must contain)."""
    if kind == "missing dir":
        return [tmp_path / "nope"], "nope: no such directory"
    run = make_run(tmp_path, "bad", "disaggregated", steps=3)
    metrics = run / "metrics.jsonl"
    if kind == "missing metrics":
        metrics.unlink()
        return [run], f"{metrics}: no such file"
    if kind == "empty metrics":
        metrics.write_text("\n")
        return [run], f"{metrics}: empty"
    if kind == "corrupt line":
        lines = metrics.read_text().splitlines()
        metrics.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
        return [run], f"{metrics}: line 2 is not valid JSON"
    if kind == "record without step":
        metrics.write_text('{"loss": 1.0}\n')
        return [run], f"{metrics}: line 1 is not a step record"
    if kind == "corrupt recipe":
        (run / "recipe.yaml").write_text("layout: [unclosed\n")
        return [run], "recipe.yaml: not valid YAML"
    (tmp_path / "file").write_text("x")  # --out names a file
    return [run, "--out", tmp_path / "file"], "file: exists and is not a directory"


@pytest.mark.parametrize("kind", ["missing dir", "missing metrics", "empty metrics", "corrupt line",
                                  "record without step", "corrupt recipe", "out is a file"])
def test_bad_input_is_one_error_line_with_exit_code_2(tmp_path, kind):
    args, expected = _break(kind, tmp_path)
    proc = run_report(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_module_names_come_from_the_logged_keys_of_any_graph():
    from pathlib import Path

    from disttrain_ds.cli.report import Run, module_names

    runs = [Run(Path("a"), "disaggregated", [{"step": 1, "time/vision_compute": 0.1, "time/llm_compute": 0.2,
                                               "balance/vision_load_mean": 1.0, "perf/mfu/vision": 0.1}]),
            Run(Path("b"), "disaggregated", [{"step": 1, "time/encoder_compute": 0.1, "time/llm_compute": 0.2}])]
    assert module_names(runs) == ["encoder", "llm", "vision"]
    assert module_names(runs, "balance/", "_load_mean") == ["vision"]
    assert module_names(runs, "perf/mfu/", "") == ["vision"]  # an empty suffix keeps the whole tail


def _png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # IHDR width


def test_validation_loss_panel_sits_beside_the_training_loss_only_when_a_run_logged_eval(tmp_path):
    from disttrain_ds.cli.report import Run, loss_panels

    plain = make_run(tmp_path, "plain", "disaggregated")
    evald = make_run(tmp_path, "evald", "disaggregated")
    rows = [json.loads(x) for x in (evald / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] % 3 == 0:  # eval.every: 3, as the runtime adds it to the step's row
            r.update({"eval/loss": 5.5 - 0.1 * r["step"], "eval/loss/llm": 4.6, "eval/loss/generator": 0.9})
    (evald / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")

    only_plain = loss_panels([Run(plain, "disaggregated", [json.loads(x) for x in
                                                           (plain / "metrics.jsonl").read_text().splitlines()])])
    assert [t for t, _ in only_plain] == ["total loss", "LM loss", "generation loss"]
    both = loss_panels([Run(plain, "?", [{"step": 1, "loss": 1.0}]), Run(evald, "?", rows)])
    assert both[-1] == ("validation loss", ["eval/loss", "eval/loss/llm", "eval/loss/generator"])

    assert run_report(plain, "--out", tmp_path / "a").returncode == 0
    proc = run_report(plain, evald, "--out", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    assert _png_width(tmp_path / "b" / "loss.png") > _png_width(tmp_path / "a" / "loss.png")  # a 4th panel
    assert "final eval loss" in proc.stdout
    evald_row = next(x for x in proc.stdout.splitlines() if x.startswith("evald"))
    plain_row = next(x for x in proc.stdout.splitlines() if x.startswith("plain"))
    assert evald_row.split()[-1] == "4.9000" and plain_row.split()[-1] == "-"

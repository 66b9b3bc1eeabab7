"""The paper's figures ship inside the package; bench scripts read them and report bad files in one line."""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.paper import PAPER_FILE, load_paper_figures, packaged_figures_name

REPO = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """A script under bench/ imported as a module (its ``main(argv)`` callable in-process)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def one_line_error(path: Path) -> str:
    """The message of the ConfigError that loading ``path`` raises; asserted one line naming it."""
    with pytest.raises(ConfigError) as exc:
        load_paper_figures(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    return msg


def test_packaged_figures_load_without_any_file_outside_the_package():
    paper = load_paper_figures()
    assert Path(packaged_figures_name()).parts[-3:] == ("disttrain_ds", "paper", PAPER_FILE)
    assert paper["hardware"]["bf16_peak_tflops"] == 312
    assert {r["model"] for r in paper["overall_fig15_16"]} == {"MLLM-9B", "MLLM-15B", "MLLM-72B"}
    assert "2408.04275" in paper["_about"]


def test_packaged_figures_equal_the_fixture_file(fixtures_dir):
    fixture = fixtures_dir / PAPER_FILE
    if not fixture.is_file():
        pytest.skip(f"{fixture} not found")
    assert load_paper_figures() == json.loads(fixture.read_text())
    assert load_paper_figures(fixture) == load_paper_figures()


def test_packaged_figures_are_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert PAPER_FILE in data["disttrain_ds.paper"]


def test_an_explicit_path_overrides_the_packaged_copy(tmp_path):
    paper = load_paper_figures()
    paper["sequence_length"] = 4096
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(paper))
    assert load_paper_figures(path)["sequence_length"] == 4096
    assert load_paper_figures()["sequence_length"] == 8192


def test_bad_figure_files_are_one_line_errors_naming_the_file(tmp_path):
    assert "not found" in one_line_error(tmp_path / "absent.json")
    assert "directory" in one_line_error(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"hardware": {,}\n')
    assert "invalid JSON at line 1" in one_line_error(bad)
    bad.write_text("[1, 2]")
    assert "JSON object" in one_line_error(bad)
    bad.write_text(json.dumps({"hardware": {}}))
    assert "missing 'llm_backbones'" in one_line_error(bad)


@pytest.mark.parametrize("script", ["bench_planner", "paper_scale"])
def test_bench_scripts_report_a_bad_paper_file_in_one_line_with_exit_code_2(script, tmp_path, run_main):
    main = bench_module(script).main
    code, out, err = run_main(main, "--paper", str(tmp_path / "absent.json"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "error:" in err and str(tmp_path / "absent.json") in err, err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_main(main, "--paper", str(bad))
    assert code == 2 and err.count("\n") == 1 and "invalid JSON" in err and "Traceback" not in err, err


def test_emulated_bench_reports_a_bad_paper_file_as_its_one_line_error(tmp_path):
    emulated = bench_module("emulated")
    with pytest.raises(emulated.BenchError, match=f"^{tmp_path / 'absent.json'}: .*not found$"):
        emulated.paper_profile(tmp_path / "absent.json")


def test_bench_planner_writes_an_example_from_the_packaged_figures(tmp_path, run_main):
    out = tmp_path / "profile.json"
    code, _, err = run_main(bench_module("bench_planner").main, "--write-example", str(out),
                            "--gpus", "112", "--batch", "240")
    assert code == 0, err
    assert json.loads(out.read_text())["gpus"] == 112

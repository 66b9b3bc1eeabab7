"""``disttrain-launch`` checks the recipe (and, with ``train.device_memory_gib``, each rank's
estimated memory) before the hostfile; each problem is the one last line it prints."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from disttrain_ds.cli import launch

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml")


@pytest.fixture
def run(run_main):
    return functools.partial(run_main, launch.main)


def test_a_bad_recipe_is_reported_before_a_bad_hostfile(run, tmp_path):
    code, out, err = run("--hostfile", str(tmp_path / "missing"), "--recipe", TINY, "train.steps=0")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "'train.steps' must be >= 1" in err


def test_a_rank_that_does_not_fit_stops_the_launch_in_one_line(run, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    code, out, err = run("--hostfile", str(hostfile), "--dry-run", "--recipe", TINY, "layout=disaggregated",
                         "train.device_memory_gib=0.005")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "rank 3 (generator stage 0) does not fit: estimate" in err
    assert "allowance" not in err  # tiny_cpu sets train.gpu_allowance false: a CPU recipe


def test_dry_run_reports_the_memory_check(run, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    code, out, _ = run("--hostfile", str(hostfile), "--dry-run", "--recipe", TINY, "layout=disaggregated",
                       "train.device_memory_gib=8")
    assert code == 0
    assert "memory: estimated peak" in out and "of 8 GiB per device: fits" in out
    code, out, _ = run("--hostfile", str(hostfile), "--dry-run", "--recipe", TINY, "layout=disaggregated")
    assert code == 0 and "memory: checked by every rank at start-up" in out

"""``python -m disttrain_ds.cli.profile --measure-tp 2``: TP=2 costs measured by two real TP ranks (gloo)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.slow  # the profiler's unit tests stay in the default tier
@pytest.mark.parametrize("tp_overlap", ["false", "true"])  # true: every module timed on slices
def test_measured_tp2_costs_replace_the_interpolated_ones(tmp_path, tp_overlap):
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "disttrain_ds.cli.profile", "--recipe", "recipes/tiny_cpu.yaml", "model.llm.layers=2",
           f"parallel.llm.tp_overlap={tp_overlap}", f"parallel.encoder.tp_overlap={tp_overlap}",
           f"parallel.generator.tp_overlap={tp_overlap}",
           "--samples", "2", "--warmup", "1", "--measure-tp", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from disttrain_ds.cost.profile_file import load_profile

    profile = load_profile(out)
    for name, m in profile.modules.items():
        interpolated = m.cost_ms[1] / (2 * 0.9 ** math.log2(2))
        assert m.cost_ms[2] > 0 and abs(m.cost_ms[2] / interpolated - 1) > 1e-9, name  # a timing, not the formula
    assert "TP=2 measured with as many processes" in profile.description
    assert "TP=2/" not in profile.description and "TP=4/8 interpolated" in profile.description
    assert "measuring TP=2 with 2 processes" in proc.stderr
    # the modules timed so
    assert ("(encoder, llm, generator on sequence slices" in proc.stderr) == (tp_overlap == "true")

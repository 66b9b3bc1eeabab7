"""Node-shared preprocessing in a real job: one producer serves every rank of the host."""

from __future__ import annotations

import pytest

from .conftest import launch, max_param_mismatch
from .test_fidelity import SGD, STEPS


@pytest.mark.slow  # the default tier keeps producers: tests/unit
def test_one_producer_per_host_feeds_every_rank_the_reference_batches(tmp_path, reference_run):
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    data = ["data.producers=1", "data.queue_depth=2", f"data.spool_dir={spool_dir}"]
    layout = ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"]
    rows, params, _ = launch(tmp_path / "job", 5, [STEPS, *SGD, *layout, *data])
    ref_losses, ref_params = reference_run([STEPS, *SGD])  # in-process data in one process
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    assert all(r["data/batch_mib"] > 0 for r in rows)
    log = (tmp_path / "job" / "launch.log").read_text()
    assert "prepared by 1 producer process per host, shared by its 5 ranks" in log
    assert list(spool_dir.iterdir()) == []  # the spool is gone once the job ends

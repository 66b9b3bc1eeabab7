"""``train.compile: true`` on a disaggregated job: every rank's layers compiled (inductor, on the
CPU here) inside DeepSpeed's engines train what the eager single-process reference trains."""

from __future__ import annotations

import pytest

from .conftest import launch, max_param_mismatch

STEPS = "train.steps=3"
SGD = ["optim.name=sgd", "optim.lr=0.05"]  # as test_fidelity.py: a wrong gradient scale would show


LAYOUTS = {
    # name: (ranks, overrides)
    "plain": (4, []),
    # Column / row-parallel linears (autograd functions around all-reduces) inside compiled layers.
    "llm_tp2_replicated": (6, ["parallel.llm.tp=2", "parallel.llm.tp_overlap=false"]),
    # The LLM on sequence slices: its blocks compiled around the overlapped collectives.
    "llm_tp2_sliced": (6, ["parallel.llm.tp=2", "parallel.llm.tp_overlap=true"]),
    # Compiled layers recomputed in backward.
    "llm_checkpointed": (4, ["parallel.llm.activation_checkpointing=1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_compiled_disaggregated_job_trains_the_eager_reference(name, tmp_path, reference_run):
    nproc, extra = LAYOUTS[name]
    # Ranks compile in step 1 on the CPU (minutes on two cores): deadlines long enough for that.
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, "layout=disaggregated", "train.compile=true",
                                               "parallel.comm_timeout_s=900", "parallel.heartbeat_timeout_s=900",
                                               *extra], timeout=1500)
    ref_losses, ref_params = reference_run([STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    # The graphs were made (an eager job's records carry no count: test_fidelity.py's rows).
    assert all(r["compile/graphs"] > 0 for r in rows)

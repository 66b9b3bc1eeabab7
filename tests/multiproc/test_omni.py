"""An image encoder and an audio encoder feeding one LLM train the reference math under NCCL's rules.

``tiny_omni`` (vit + whisper -> LLM -> unet) runs disaggregated with both encoders fanning in over
DP=2 to one PP=2 LLM replica, and matches its single-process reference in per-step losses and final
parameters (fp32, SGD). Negative controls: the audio rows scattered into the wrong placeholders,
and the audio encoder's gradient dropped, are both caught by the same comparison.
"""

from __future__ import annotations

import pytest

from .conftest import launch, max_param_mismatch
from .test_fidelity import SGD, STEPS

FAN_IN = ["parallel.modules.vision.dp=2", "parallel.modules.ear.dp=2", "train.micro_batch=2"]


def _run(tmp_path, reference_run, overrides: list[str], nproc: int, fault: str | None = None):
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, "layout=disaggregated", *overrides], fault=fault,
                             recipe="tiny_omni")
    ref_losses, ref_params = reference_run([STEPS, *SGD, *overrides], "tiny_omni")
    return rows, params, ref_losses, ref_params


@pytest.mark.slow  # the default tier keeps fan-in: test_graphs.py's understanding-only graph
def test_two_encoders_fanning_in_to_a_split_llm_match_reference(tmp_path, reference_run):
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, FAN_IN, 7)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    assert {k.split("/")[0] for k in params} == {"vision", "ear", "llm", "painter"}
    last = rows[-1]
    assert last["loss/gen"] > 0 and all(f"time/{m}_compute" in last for m in ("vision", "ear", "llm", "painter"))
    assert all(last[f"perf/mfu/{m}"] > 0 for m in ("vision", "ear", "llm", "painter"))


@pytest.mark.slow  # a 7-rank job; the two-encoder fan-in itself is pinned above in the default tier
def test_audio_rows_in_the_wrong_placeholders_are_caught(tmp_path, reference_run):
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, FAN_IN, 7, fault="swap_audio_rows")
    assert rows[0]["loss"] != pytest.approx(ref_losses[0], rel=1e-5)  # same weights, other sequence
    ear = {k: v for k, v in params.items() if k.startswith("ear/")}
    assert max_param_mismatch(ear, {k: ref_params[k] for k in ear})[0] > 1e-4


@pytest.mark.slow
def test_dropped_audio_encoder_gradient_is_caught(tmp_path, reference_run):
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, FAN_IN, 7, fault="drop_ear_grad")
    ear = {k: v for k, v in params.items() if k.startswith("ear/")}
    assert max_param_mismatch(ear, {k: ref_params[k] for k in ear})[0] > 1e-3
    vision = {k: v for k, v in params.items() if k.startswith("vision/")}
    assert max_param_mismatch(vision, {k: ref_params[k] for k in vision})[0] > 1e-5  # later steps see other states


@pytest.mark.slow
@pytest.mark.parametrize("overrides, nproc", [
    # The audio encoder has two stages, the image encoder one: the image encoder starts a stage later.
    (["parallel.modules.ear.pp=2"], 6),
    # And the other way round, with the image encoder's replicas fanning in.
    (["parallel.modules.vision.pp=2", "parallel.modules.vision.dp=2", "train.micro_batch=2"], 8),
    # The LLM over two replicas, each fed by one replica of each encoder; the generator on one.
    (["parallel.modules.vision.dp=2", "parallel.modules.ear.dp=2", "parallel.modules.llm.dp=2",
      "parallel.modules.llm.pp=1"], 7),
    # Tensor parallelism in the audio encoder and the LLM: TP index 0 receives both encoders' rows.
    (["parallel.modules.ear.tp=2", "parallel.modules.llm.tp=2"], 8),
])
def test_other_omni_layouts_match_reference(tmp_path, reference_run, overrides, nproc):
    rows, params, ref_losses, ref_params = _run(tmp_path, reference_run, overrides, nproc)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"

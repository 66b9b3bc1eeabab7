"""Activation checkpointing (``parallel.<module>.activation_checkpointing``) recomputes blocks of
layers in backward and trains exactly the reference model."""

from __future__ import annotations

import json

import pytest

from .conftest import launch, max_param_mismatch

STEPS = "train.steps=3"
SGD = ["optim.name=sgd", "optim.lr=0.05"]
# encoder 1 rank, LLM 2 stages, generator 1 rank; blocks of 2, 1 and 3 layers.
LAYOUT = ["layout=disaggregated", "parallel.encoder.activation_checkpointing=2",
          "parallel.llm.activation_checkpointing=1", "parallel.generator.activation_checkpointing=3"]


def recompute_counts(out) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("recompute_rank*.json"))]


@pytest.mark.slow  # a whole job; checkpointing's unit tests stay in the default tier
def test_checkpointed_layers_rerun_in_backward_and_match_the_reference(tmp_path, reference_run):
    rows, params, _ = launch(tmp_path, 4, [STEPS, *SGD, *LAYOUT])
    ref_losses, ref_params = reference_run([STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    counts = recompute_counts(tmp_path)
    assert len(counts) == 4
    # Every rank checkpointed blocks, and ran each block's layers again in backward.
    assert all(c["blocks"] > 0 and c["runs"] == 2 * c["blocks"] for c in counts), counts


@pytest.mark.slow
def test_a_recompute_that_differs_from_the_forward_is_detected(tmp_path, reference_run):
    """Negative control: the fidelity check above fails when the backward's rerun is off."""
    rows, params, _ = launch(tmp_path, 4, [STEPS, *SGD, *LAYOUT], fault="perturb_recompute")
    _, ref_params = reference_run([STEPS, *SGD])
    assert max_param_mismatch(params, ref_params)[0] > 1e-5

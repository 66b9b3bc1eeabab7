"""The disaggregated and monolithic layouts train exactly the reference model (fp32, gloo).

Each case launches real processes with torchrun, trains 3 optimizer steps of the tiny recipe and
compares per-step losses and final parameters with the single-process reference.
"""

from __future__ import annotations

import pytest

from .conftest import REPO, launch, max_param_mismatch

# SGD, not Adam: Adam normalises gradients, so a wrong scale (DP fan-in, accumulation) would hide,
# and it blows parameters whose true gradient is zero (attention key biases) up to full-size steps
# driven by rounding noise that differs between summation orders.
STEPS = "train.steps=3"
SGD = ["optim.name=sgd", "optim.lr=0.05"]
LAYOUTS = {
    # name: (ranks, overrides)
    "enc1_llm_pp2_gen1": (4, ["layout=disaggregated"]),
    "enc_dp2_llm_pp2_gen1": (5, ["layout=disaggregated", "parallel.encoder.dp=2", "train.micro_batch=2"]),
    "enc1_llm_dp2_gen_dp2": (
        5,
        ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"],
    ),
    "monolithic_pp2": (4, ["layout=monolithic"]),
    # Some microbatches have nothing to generate: the generator runs on a zero-weight stand-in.
    "some_samples_generate_nothing": (
        5,
        ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2", "data.gen_images=[0,1]"],
    ),
}


def _ref_overrides(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(("layout=", "parallel."))] + [STEPS, *SGD]


def test_overrides_reach_the_reference():
    assert "data.gen_images=[0,1]" in _ref_overrides(LAYOUTS["some_samples_generate_nothing"][1])


SLOW = {"enc1_llm_dp2_gen_dp2", "enc_dp2_llm_pp2_gen1", "some_samples_generate_nothing", "monolithic_pp2"}
"""Layouts left to the slow tier (the default tier keeps ``enc1_llm_pp2_gen1``, the
communicator's fan-out test in test_comm.py and test_tensor_parallel.py's ``enc_dp2_llm_tp2_gen_tp2``,
which fans two encoder replicas in); their whole-job twins, also slow: test_post_balance.py's
layout fans two LLM replicas out to two generator replicas, with microbatches that generate nothing
(the zero-weight stand-in), and test_reshard.py's README layout the same fan-out over contiguous
blocks; ``monolithic_pp2`` is the same chain as one engine."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_matches_reference_losses_and_parameters(name, tmp_path, reference_run):
    nproc, overrides = LAYOUTS[name]
    rows, params, shapes = launch(tmp_path, nproc, [STEPS, *SGD, *overrides])
    ref_losses, ref_params = reference_run(_ref_overrides(overrides))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    # Images per sample vary, so the encoder output crossing to the LLM changed shape between microbatches.
    assert len({tuple(s) for per_rank in shapes for s in per_rank}) > 2
    # One writer: per-module times gathered into each row, and one timeline file per rank.
    for module in ("encoder", "llm", "generator"):
        assert all(r[f"time/{module}_compute"] > 0 for r in rows)
        assert all(0 < r[f"perf/mfu/{module}"] < 1 and r[f"memory/{module}_peak_gib"] > 0 for r in rows)
    for key in ("time/step", "time/bubble", "time/comm_wait", "balance/encoder_load_max", "perf/tokens_per_s"):
        assert all(key in r for r in rows), key
    assert len(list((tmp_path / "run" / "trace").glob("rank*.json"))) == nproc


def test_dropped_encoder_gradient_is_detected(tmp_path, reference_run):
    """Negative control: zeroing the gradient sent back to the encoder must break fidelity."""
    nproc, overrides = LAYOUTS["enc1_llm_pp2_gen1"]
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, *overrides], fault="drop_encoder_grad")
    _, ref_params = reference_run(_ref_overrides(overrides))
    enc = {k: v for k, v in params.items() if k.startswith("encoder/")}
    worst, _ = max_param_mismatch(enc, {k: ref_params[k] for k in enc})
    assert worst > 1e-3
    llm = {k: v for k, v in params.items() if k.startswith("llm/")}
    assert max_param_mismatch(llm, {k: ref_params[k] for k in llm})[0] > 1e-5  # later steps see other activations


FROZEN_CASES = {
    # The whole encoder module frozen (its engine runs no backward) while the rest trains.
    "frozen_encoder": (["model.encoder.frozen=true", "model.encoder.projector.frozen=true"], ("llm/", "generator/")),
    # LLaVA's first stage: encoder and LLM frozen, only the input projector trains; gradients
    # pass through the frozen LLM to it.
    "projector_only": (["model.encoder.frozen=true", "model.llm.frozen=true", "model.generator.frozen=true",
                        "model.generator.projector.frozen=true"], ("encoder/projector/",)),
}


@pytest.mark.slow  # whole jobs; freezing's unit tests stay in the default tier
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "frozen_encoder" else c
                                  for c in sorted(FROZEN_CASES)])  # projector_only freezes whole engines too
def test_frozen_parts_stay_bit_identical_while_the_rest_trains(case, tmp_path, reference_run):
    from disttrain_ds.mllm.model import ReferenceMLLM
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.reference import reference_layer_state
    from disttrain_ds.runtime.setup import build_data_and_spec

    frozen, trained = FROZEN_CASES[case]
    rows, params, _ = launch(tmp_path, 4, [STEPS, *SGD, "layout=disaggregated", *frozen])
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", frozen)
    initial = reference_layer_state(ReferenceMLLM(build_data_and_spec(recipe)[1]))
    moved = {k for k in params if not params[k].equal(initial[k])}
    assert moved and all(k.startswith(trained) for k in moved), sorted(moved)[:5]
    for prefix in trained:
        assert any(k.startswith(prefix) for k in moved), prefix
    ref_losses, ref_params = reference_run([*frozen, STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"

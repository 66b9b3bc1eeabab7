"""Validation loss in the pipeline layouts: forward passes through the same engines and boundary
links as training give the reference's held-out losses, and leave training as it was."""

from __future__ import annotations

import pytest

from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.reference import train_reference

from .conftest import launch

# The README's layout of tiny_cpu: encoder, LLM over 2 pipeline stages, generator (4 ranks).
LAYOUT = ["layout=disaggregated"]
RUN = ["train.steps=3", "optim.name=sgd", "optim.lr=0.05", "eval.every=2", "eval.batches=2"]
KEYS = ("eval/loss", "eval/loss/llm", "eval/loss/generator")


@pytest.fixture(scope="module")
def reference_eval():
    """Reference records with evaluation on, and the training losses of the same run without it."""
    with_eval, _ = train_reference(load_recipe("tiny_cpu", RUN), None, log=None)
    without, _ = train_reference(load_recipe("tiny_cpu", [*RUN, "eval.every=0"]), None, log=None)
    return with_eval, [r["loss"] for r in without]


def _evals(rows: list[dict]) -> dict[int, list[float]]:
    return {r["step"]: [r[k] for k in KEYS] for r in rows if "eval/loss" in r}


@pytest.mark.slow  # a whole job; eval's unit tests stay in the default tier
def test_pipeline_eval_loss_equals_the_reference_and_training_is_unchanged(tmp_path, reference_eval):
    ref, ref_losses_without_eval = reference_eval
    rows, _, _ = launch(tmp_path, 4, [*RUN, *LAYOUT])
    assert [r["loss"] for r in ref] == ref_losses_without_eval  # evaluation leaves the reference bit-identical
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses_without_eval, rel=1e-5)
    ours, theirs = _evals(rows), _evals(ref)
    assert sorted(ours) == sorted(theirs) == [2, 3]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5), step


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [
    (5, ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"]),
    (4, ["layout=monolithic"]),
], ids=["llm_dp2_gen_dp2", "monolithic_pp2"])
def test_eval_loss_matches_the_reference_in_other_layouts(nproc, layout, tmp_path, reference_eval):
    ref, _ = reference_eval
    rows, _, _ = launch(tmp_path, nproc, [*RUN, *layout])
    ours, theirs = _evals(rows), _evals(ref)
    assert sorted(ours) == [2, 3] and all(ours[s] == pytest.approx(theirs[s], rel=1e-5) for s in ours)


@pytest.mark.slow
def test_pipeline_eval_that_loses_the_encoder_output_is_caught(tmp_path, reference_eval):
    """Negative control: zeroing the encoder's activations during evaluation only must break the
    eval match while the training losses still match."""
    ref, ref_losses = reference_eval
    rows, _, _ = launch(tmp_path, 4, [*RUN, *LAYOUT], fault="eval_zero_encoder")
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    ours, theirs = _evals(rows), _evals(ref)
    assert all(abs(ours[s][1] - theirs[s][1]) > 1e-3 * abs(theirs[s][1]) for s in ours)


def _ref_evals(recipe: str, overrides: list[str], keys: tuple[str, ...]) -> dict[int, list[float]]:
    rows, _ = train_reference(load_recipe(recipe, [*RUN, *overrides]), None, log=None)
    return {r["step"]: [r[k] for k in keys] for r in rows if "eval/loss" in r}


@pytest.mark.slow
def test_eval_loss_without_a_generator_equals_the_reference(tmp_path):
    """tiny_vlm (vision -> llm, no generator): the LLM's last stage sends nothing downstream and the
    evaluation record has no generator loss."""
    keys = ("eval/loss", "eval/loss/llm")
    rows, _, _ = launch(tmp_path, 3, [*RUN, "layout=disaggregated"], recipe="tiny_vlm")
    ours = {r["step"]: [r[k] for k in keys] for r in rows if "eval/loss" in r}
    theirs = _ref_evals("tiny_vlm", [], keys)
    assert sorted(ours) == sorted(theirs) == [2, 3]
    assert all(not any(k.startswith("eval/loss/") and k != "eval/loss/llm" for k in r) for r in rows)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5), step


@pytest.mark.slow
def test_eval_loss_with_tensor_parallel_modules_equals_the_reference(tmp_path, reference_eval):
    """TP=2 in the LLM and the generator: TP index 0 talks across both boundaries and broadcasts to
    its TP partner during evaluation as in training."""
    ref, ref_losses = reference_eval
    rows, _, _ = launch(tmp_path, 5, [*RUN, *LAYOUT, "parallel.llm.tp=2", "parallel.llm.pp=1",
                                      "parallel.generator.tp=2"])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    ours, theirs = _evals(rows), _evals(ref)
    assert sorted(ours) == [2, 3] and all(ours[s] == pytest.approx(theirs[s], rel=1e-5) for s in ours)

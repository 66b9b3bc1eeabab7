"""Per-module post-balancing trains the reference math: encoders split each microbatch's images and
generators its target images over their replicas by their own costs, with unequal counts, and the
boundaries route every unit's rows between the replicas that hold them (fp32, NCCL's point-to-point
rules)."""

from __future__ import annotations

import pytest

from .conftest import launch, max_param_mismatch

STEPS = "train.steps=3"
SGD = ["optim.name=sgd", "optim.lr=0.05"]
# Four samples per microbatch slot (LLM DP 2 x micro_batch 2), encoder and generator on two replicas
# each; images per sample and targets per sample vary, so the two modules split the slot differently.
# The seed gives a microbatch with one target image in all (one generator replica holds none).
SEED = "seed=1207"
LAYOUT = [SEED, "layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.encoder.dp=2",
          "parallel.generator.dp=2", "train.micro_batch=2", "train.global_batch=8", "data.gen_images=[0,2]",
          "parallel.post_balance=true"]
REFERENCE = [STEPS, *SGD, SEED, "train.micro_batch=2", "train.global_batch=8", "data.gen_images=[0,2]"]


@pytest.mark.slow  # a whole job; post-balancing's unit tests stay in the default tier
def test_post_balanced_layout_matches_the_reference(tmp_path, reference_run):
    rows, params, shapes = launch(tmp_path, 6, [STEPS, *SGD, *LAYOUT])
    ref_losses, ref_params = reference_run(REFERENCE)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    # The balance figures are the post-balanced replicas' loads.
    assert all(r["balance/encoder_load_max"] >= 1.0 for r in rows)
    # The run's samples were split unequally somewhere (the same deterministic placement every rank made).
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.placement import Placement
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe("tiny_cpu", [STEPS, *LAYOUT])
    source, spec = build_data_and_spec(recipe)
    placement = Placement(recipe, spec, {"encoder": 2, "llm": 2, "generator": 2})
    batches = [source.global_batch(step) for step in range(3)]
    source.close()
    plans = [(b, j, plan) for b in batches for j, plan in enumerate(placement.plans(b))]
    # Some generator replica had nothing to generate in a microbatch: it ran the zero-weight stand-in.
    targets = [list(map(len, plan.units["generator"])) for _, _, plan in plans]
    assert any(0 in t for t in targets), targets
    # Unequal counts: the two generator replicas held different numbers of samples' targets.
    assert any(len({p for p, _ in a}) != len({p for p, _ in b}) for _, _, plan in plans
               for a, b in [plan.units["generator"]])
    # One sequence's images were encoded, and one sequence's targets generated, on both replicas.
    for module in ("encoder", "generator"):
        split = [{r for r, part in enumerate(plan.units[module]) for p, _ in part if p == q}
                 for _, _, plan in plans for q in range(4)]
        assert any(len(replicas) == 2 for replicas in split), module


@pytest.mark.slow  # the default tier keeps the post-balanced layout itself stays
def test_rows_left_in_arrival_order_are_caught(tmp_path, reference_run):
    """Negative control: a replica that does not put rows from several replicas back in its samples'
    order trains on other samples' rows."""
    rows, params, _ = launch(tmp_path, 6, ["train.steps=2", *SGD, *LAYOUT], fault="post_balance_unplaced")
    _, ref_params = reference_run(["train.steps=2", *REFERENCE[1:]])
    worst, _ = max_param_mismatch(params, ref_params)
    assert worst > 1e-3


@pytest.mark.slow  # 8 ranks; the default tier pins the routing and its negative control above
def test_two_encoders_post_balanced_over_a_split_image_encoder_match_the_reference(tmp_path, reference_run):
    """The image and audio encoders each split the slot by their own costs (the image encoder over
    two replicas of two pipeline stages), both fanning in to one LLM replica of two stages."""
    overrides = ["parallel.modules.vision.dp=2", "parallel.modules.vision.pp=2", "parallel.modules.ear.dp=2",
                 "train.micro_batch=4", "data.max_audio=3"]
    rows, params, _ = launch(tmp_path, 9, [STEPS, *SGD, "layout=disaggregated", "parallel.post_balance=true",
                                           *overrides], recipe="tiny_omni")
    ref_losses, ref_params = reference_run([STEPS, *SGD, *overrides], "tiny_omni")
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"

"""Longer multi-process checks (``-m slow``): deeper pipelines in every module, a frozen backbone
between trainable modules, and bf16 with ZeRO-1."""

from __future__ import annotations

import pytest

from .conftest import REPO, launch, max_param_mismatch
from .test_fidelity import SGD, STEPS

pytestmark = pytest.mark.slow


def test_every_module_pipelined_matches_reference(tmp_path, reference_run):
    overrides = ["layout=disaggregated", "parallel.encoder.pp=2", "parallel.generator.pp=3"]
    rows, params, _ = launch(tmp_path, 7, [STEPS, *SGD, *overrides])
    ref_losses, ref_params = reference_run([STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where}: {worst:.2e}"


def test_frozen_llm_passes_gradients_to_trainable_encoder(tmp_path, reference_run):
    from disttrain_ds.mllm.model import ReferenceMLLM
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.reference import reference_layer_state
    from disttrain_ds.runtime.setup import build_data_and_spec

    frozen = ["model.llm.frozen=true"]
    rows, params, _ = launch(tmp_path, 4, [STEPS, *SGD, "layout=disaggregated", *frozen])
    initial = reference_layer_state(ReferenceMLLM(build_data_and_spec(load_recipe(REPO / "recipes" / "tiny_cpu.yaml", frozen))[1]))
    assert all(params[k].equal(initial[k]) for k in params if k.startswith("llm/"))
    assert any(not params[k].equal(initial[k]) for k in params if k.startswith("encoder/"))
    ref_losses, ref_params = reference_run([*frozen, STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    assert max_param_mismatch(params, ref_params)[0] < 1e-5


def test_bf16_zero1_trains_close_to_fp32_reference(tmp_path, reference_run):
    rows, _, _ = launch(
        tmp_path, 4, [STEPS, "layout=disaggregated", "train.dtype=bf16", "deepspeed_config=ds_configs/zero1.json"]
    )
    ref_losses, _ = reference_run([STEPS])
    losses = [r["loss"] for r in rows]
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    assert losses[-1] < losses[0]

"""Tensor parallelism inside module engines trains exactly the reference model (fp32, gloo).

Each case shards some modules over TP groups, composed with their DP and PP, and compares the
per-step losses and the (gathered) parameters after 3 SGD steps with the single-process
reference. Only TP index 0 of a stage talks across a module boundary; its TP peers receive by
broadcast, so the inter-engine traffic is the same as without TP.
"""

from __future__ import annotations

import json

import pytest

from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe

from .conftest import REPO, launch, max_param_mismatch
from .test_fidelity import SGD, STEPS

LAYOUTS = {
    # name: (ranks, overrides)
    # Fan-in from two encoder replicas into a TP group, and TP on both sides of the second boundary;
    # the LLM on sequence slices with overlapped collectives (what CUDA runs by default).
    "enc_dp2_llm_tp2_sliced_gen_tp2": (
        6,
        ["layout=disaggregated", "parallel.encoder.dp=2", "train.micro_batch=2", "parallel.llm.tp=2",
         "parallel.llm.pp=1", "parallel.generator.tp=2", "parallel.llm.tp_overlap=true",
         "parallel.llm.tp_overlap_chunks=3"],
    ),
}
SLOW_LAYOUTS = {
    # Qwen2 (a second LLM family): its biased q/k/v shard with their rows; LLM TP=2 x PP=2.
    "qwen2_llm_tp2_pp2": (6, ["layout=disaggregated", "model.llm.family=qwen2", "parallel.llm.tp=2"]),
    "llm_tp2_pp2": (6, ["layout=disaggregated", "parallel.llm.tp=2", "parallel.llm.tp_overlap=false"]),
    # Slices cross a pipeline stage boundary (each TP rank sends its own slice), under activation
    # checkpointing (recomputed gathers), and with Qwen2's biased q/k/v.
    "llm_tp2_pp2_sliced_checkpointed": (
        6, ["layout=disaggregated", "parallel.llm.tp=2", "parallel.llm.tp_overlap=true",
            "parallel.llm.activation_checkpointing=1"]),
    "qwen2_llm_tp2_pp2_sliced": (6, ["layout=disaggregated", "model.llm.family=qwen2", "parallel.llm.tp=2",
                                     "parallel.llm.tp_overlap=true", "parallel.llm.tp_overlap_chunks=2"]),
    "enc_tp2_llm_tp2_pp2_gen1": (7, ["layout=disaggregated", "parallel.encoder.tp=2", "parallel.llm.tp=2"]),
    # The ViT encoder on slices of its packed image rows (padding rows where they do not split).
    "enc_tp2_sliced_llm_tp2_pp2_gen1": (7, ["layout=disaggregated", "parallel.encoder.tp=2",
                                            "parallel.encoder.tp_overlap=true", "parallel.encoder.tp_overlap_chunks=3",
                                            "parallel.llm.tp=2"]),
    # Monolithic: encoder and generator stages share the LLM's TP (and DP) degree.
    "monolithic_tp2_pp2": (8, ["layout=monolithic", "parallel.llm.tp=2"]),
    "monolithic_tp2_pp2_sliced": (8, ["layout=monolithic", "parallel.llm.tp=2", "parallel.llm.tp_overlap=true"]),
    "llm_dp2_tp2_gen_dp2": (
        7,
        ["layout=disaggregated", "parallel.llm.dp=2", "parallel.llm.tp=2", "parallel.llm.pp=1",
         "parallel.generator.dp=2"],
    ),
}


def _ref_overrides(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(("layout=", "parallel."))] + [STEPS, *SGD]


def _check(name: str, layouts: dict, tmp_path, reference_run, launcher: str = "torchrun") -> None:
    nproc, overrides = layouts[name]
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, *overrides], launcher=launcher)
    ref_losses, ref_params = reference_run(_ref_overrides(overrides))
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    sliced = "tensor parallelism on sequence slices" in (tmp_path / "launch.log").read_text()
    assert sliced == any(o.endswith(".tp_overlap=true") for o in overrides)  # the path named is the path taken

    # No duplicated boundary traffic: only TP index 0 ranks send across module boundaries.
    topo = topology_of(load_recipe(REPO / "recipes" / "tiny_cpu.yaml", overrides))
    senders = set()
    for rank in range(nproc):
        sends = json.loads((tmp_path / f"sends_rank{rank}.json").read_text())
        _, _, tp_index = topo.module_of(rank).coords(rank)
        if sends:
            senders.add(rank)
            assert tp_index == 0, f"rank {rank} (tp index {tp_index}) sent {len(sends)} boundary messages"
    if topo.layout == "disaggregated":
        assert senders  # the boundaries were crossed, by TP index 0 ranks


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_layout_matches_reference(name, tmp_path, reference_run):
    # Under the launcher users take for multi-node jobs (no agent, every group a world-wide split):
    # the default tier's mixed-TP job under it (test_startup_eager.py's own is in the slow tier).
    _check(name, LAYOUTS, tmp_path, reference_run, launcher="deepspeed")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_more_tensor_parallel_layouts_match_reference(name, tmp_path, reference_run):
    _check(name, SLOW_LAYOUTS, tmp_path, reference_run)


@pytest.mark.slow
def test_boundary_traffic_is_the_same_with_and_without_tp(tmp_path, reference_run):
    """Same elements cross each boundary whether the LLM is sharded over 2 TP ranks or not."""
    base = ["layout=disaggregated", "train.steps=1", *SGD]
    totals = []
    for tp, nproc in ((1, 4), (2, 6)):
        out = tmp_path / f"tp{tp}"
        launch(out, nproc, [*base, f"parallel.llm.tp={tp}"])
        sends = [json.loads((out / f"sends_rank{r}.json").read_text()) for r in range(nproc)]
        totals.append(sorted(sum(n for _, n in s) for s in sends if s))
    assert totals[0] == totals[1] and totals[0]


def _sliced_job_trains_the_reference(tmp_path, reference_run, recipe: str, nproc: int, overrides: list[str],
                                      sliced: tuple[str, ...]) -> None:
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, "layout=disaggregated", *overrides], recipe=recipe)
    ref_losses, ref_params = reference_run([STEPS, *SGD], recipe)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    log = (tmp_path / "launch.log").read_text()
    assert all(f"{m}: tensor parallelism on sequence slices" in log for m in sliced)


@pytest.mark.slow
def test_audio_and_image_encoders_on_slices_train_the_reference(tmp_path, reference_run):
    """tiny_omni: the Whisper and ViT encoders each at TP 2 on slices of their packed rows (clips and
    images of several sizes, padding rows where they do not split)."""
    overrides = ["parallel.modules.ear.tp=2", "parallel.modules.ear.tp_overlap=true", "parallel.modules.vision.tp=2",
                 "parallel.modules.vision.tp_overlap=true"]
    _sliced_job_trains_the_reference(tmp_path, reference_run, "tiny_omni", 7, overrides, ("ear", "vision"))


def test_both_generators_on_slices_train_the_reference(tmp_path, reference_run):
    """tiny_two_gen: the DiT generator (``sketcher``) at TP 2 x PP 2 on slices of its images' patch
    tokens (each TP rank sends its own slice to the next stage, the condition and modulation whole),
    and the U-Net (``painter``) at TP 2 with its transformer blocks on slices inside each block."""
    overrides = ["parallel.modules.llm.pp=1", "parallel.modules.sketcher.tp=2", "parallel.modules.sketcher.pp=2",
                 "parallel.modules.sketcher.tp_overlap=true", "parallel.modules.sketcher.tp_overlap_chunks=3",
                 "parallel.modules.painter.tp=2", "parallel.modules.painter.tp_overlap=true"]
    _sliced_job_trains_the_reference(tmp_path, reference_run, "tiny_two_gen", 8, overrides, ("sketcher", "painter"))

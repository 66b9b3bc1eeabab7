"""Module graphs other than encoder -> LLM -> generator train the reference math under NCCL's rules.

``tiny_vlm`` (image encoder -> LLM, no generator) and a generation-only graph (LLM -> generator,
no encoder, written here as a recipe file) run disaggregated and match their single-process
reference in per-step losses and final parameters (fp32, SGD); the generation-only graph also with a
DiT generator split over two or three pipeline stages. The negative control for these comparisons is
the dropped-gradient run in test_fidelity.py.
"""

from __future__ import annotations

import pytest

from .conftest import REPO, launch, max_param_mismatch
from .test_fidelity import SGD, STEPS

T2I = """\
name: tiny_t2i
seed: 1234
model:
  modules:
    llm: {family: llama, preset: tiny}
    painter: {family: unet, preset: tiny}
data: {source: synthetic, tokenizer: byte, seq_len: 128, max_images: 0, image_sizes: [16]}
parallel:
  modules:
    llm: {pp: 2}
train: {steps: 20, global_batch: 4, micro_batch: 1}
deepspeed_config: ds_configs/cpu_fp32.json
"""


def _check(tmp_path, reference_run, recipe: str, nproc: int, overrides: list[str]) -> dict:
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, "layout=disaggregated", *overrides], recipe=recipe)
    ref_losses, ref_params = reference_run([STEPS, *SGD, *overrides], recipe)
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    assert set(k.split("/")[0] for k in params) == set(k.split("/")[0] for k in ref_params)
    return rows[-1]


def test_understanding_only_graph_with_encoder_fan_in_matches_reference(tmp_path, reference_run):
    # vision DP=2 fans in to a PP=2 LLM; no generator anywhere; the vision tower and its
    # projector train at their own learning rates.
    last = _check(tmp_path, reference_run, "tiny_vlm", 4, ["parallel.modules.vision.dp=2", "train.micro_batch=2",
                                                           "optim.module_lr.vision=0.003",
                                                           "optim.module_lr.vision/projector=0.02"])
    assert last["loss/gen"] == 0.0 and "perf/mfu/vision" in last and "time/vision_compute" in last


@pytest.mark.slow
def test_generation_only_graph_matches_reference(tmp_path, reference_run):
    recipe = tmp_path / "tiny_t2i.yaml"
    recipe.write_text(T2I.replace("ds_configs/cpu_fp32.json", str(REPO / "ds_configs" / "cpu_fp32.json")))
    last = _check(tmp_path / "run", reference_run, str(recipe), 3, [])
    assert last["loss/gen"] > 0 and "time/painter_compute" in last


@pytest.mark.parametrize("pp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_generation_only_graph_with_a_split_dit_matches_reference(tmp_path, reference_run, pp):
    # Projector, dit_in, block0, block1, dit_out split in two stages send (hidden, t_mod, t_emb,
    # cond) from block0 to block1; in three, that tuple from dit_in and (hidden, t_emb) from the last block.
    recipe = tmp_path / "tiny_t2i_dit.yaml"
    recipe.write_text(T2I.replace("family: unet", "family: dit").replace(
        "ds_configs/cpu_fp32.json", str(REPO / "ds_configs" / "cpu_fp32.json")))
    last = _check(tmp_path / "run", reference_run, str(recipe), 1 + pp,
                  ["parallel.modules.llm.pp=1", f"parallel.modules.painter.pp={pp}"])
    assert last["loss/gen"] > 0 and last["perf/mfu/painter"] > 0 and last["perf/mfu/llm"] > 0

"""A disaggregated job that starts from pretrained parts saved by transformers (a CLIP tower and a
Llama with tied embeddings, LLaVA-style) trains the single-process reference's math from the same
weights: the tower split over TP=2, the LLM over two pipeline stages holding the two copies of its
tied embedding. Losses per step and the parameters after 3 SGD steps match (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import transformers

from disttrain_ds.estimate.memory import vocab_size
from disttrain_ds.recipe.schema import load_recipe

from .conftest import launch, max_param_mismatch
from .test_fidelity import SGD, STEPS

TOWERS = {"clip": ("CLIPVisionConfig", "CLIPVisionModel"), "siglip": ("SiglipVisionConfig", "SiglipVisionModel")}


def _save(tmp_path, tower: str = "clip") -> list[str]:
    """A vision tower and a tied Llama, random but not the presets' shapes, as save_pretrained dirs."""
    vocab = vocab_size(load_recipe("tiny_vlm"))
    config, model = TOWERS[tower]
    with torch.random.fork_rng():
        torch.manual_seed(21)
        clip = getattr(transformers, model)(getattr(transformers, config)(
            hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, image_size=32,
            patch_size=8))
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True))
    clip.save_pretrained(tmp_path / tower)
    llama.save_pretrained(tmp_path / "llama")
    return [f"model.modules.vision.family={tower}", f"model.modules.vision.checkpoint={tmp_path / tower}",
            f"model.modules.llm.checkpoint={tmp_path / 'llama'}"]


def _job_matches_reference(tmp_path, reference_run, parts: list[str]) -> list[float]:
    """The parts' job with the tower at TP=2 and the LLM over 2 stages against its reference; its losses."""
    layout = ["layout=disaggregated", "parallel.modules.vision.tp=2", "parallel.modules.llm.pp=2"]
    rows, params, _ = launch(tmp_path / "run", 4, [STEPS, *SGD, *parts, *layout], recipe="tiny_vlm")
    ref_losses, ref_params = reference_run([*parts, STEPS, *SGD], "tiny_vlm")
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    return ref_losses


def test_a_llava_style_job_from_transformers_weights_matches_its_reference(tmp_path, reference_run):
    ref_losses = _job_matches_reference(tmp_path, reference_run, _save(tmp_path))
    # The run started from the checkpoints, not the seeded init: its first loss is the imported model's.
    seeded, _ = reference_run([STEPS, *SGD, "model.modules.vision.family=clip", "model.modules.vision.layers=3",
                               "model.modules.vision.hidden_size=48", "model.modules.vision.heads=4",
                               "model.modules.vision.ffn_hidden=96"], "tiny_vlm")
    assert abs(seeded[0] - ref_losses[0]) > 1e-3


@pytest.mark.slow
def test_a_siglip_tower_split_over_tp_from_transformers_weights_matches_its_reference(tmp_path, reference_run):
    _job_matches_reference(tmp_path, reference_run, _save(tmp_path, "siglip"))

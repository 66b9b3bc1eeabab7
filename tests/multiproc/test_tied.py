"""Tied input and output embeddings train the reference's one weight in every layout: one
parameter where the embedding and the LM head share a stage (the head then split by vocabulary rows
under TP, the embedding with it), two copies whose gradients are summed across the first and last
pipeline stage otherwise. Losses per step and the parameters after 3 SGD steps match the
single-process reference (fp32); leaving out the sum is caught."""

from __future__ import annotations

import pytest
import torch

from .conftest import launch, max_param_mismatch
from .test_fidelity import SGD, STEPS
from .test_reshard import first_three_steps, resume

TIE = "model.llm.tie_embeddings=true"
PP2 = (4, ["layout=disaggregated"])
LAYOUTS = {
    # name: (ranks, overrides)
    "llm_tp2_pp2": (6, ["layout=disaggregated", "parallel.llm.tp=2"]),
}
SLOW_LAYOUTS = {
    "llm_pp2": PP2,
    # One stage: one parameter, vocabulary-split embedding and head on each TP rank.
    "llm_tp2_pp1_dp2": (7, ["layout=disaggregated", "parallel.llm.tp=2", "parallel.llm.pp=1", "parallel.llm.dp=2",
                            "train.micro_batch=2", "parallel.generator.dp=2"]),
    "llm_pp3": (5, ["layout=disaggregated", "parallel.llm.pp=3"]),
}


def _check(nproc: int, overrides: list[str], tmp_path, reference_run, fault: str | None = None) -> float:
    rows, params, _ = launch(tmp_path, nproc, [STEPS, *SGD, TIE, *overrides], fault=fault)
    ref_losses, ref_params = reference_run([o for o in overrides if not o.startswith(("layout=", "parallel."))]
                                           + [TIE, STEPS, *SGD])
    worst, where = max_param_mismatch(params, ref_params)
    embed, head = params["llm/embed/embed_tokens.weight"], params["llm/head/lm_head.weight"]
    if fault is None:
        assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
        assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
        assert (embed - head).abs().max() < 1e-6  # the two copies stayed one weight
    return worst


@pytest.mark.slow  # whole jobs; the default tier keeps the pretrained LLaVA-style job
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tied_embeddings_train_the_reference_weight(name, tmp_path, reference_run):
    _check(*LAYOUTS[name], tmp_path, reference_run)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_tied_embeddings_in_more_layouts(name, tmp_path, reference_run):
    _check(*SLOW_LAYOUTS[name], tmp_path, reference_run)


@pytest.mark.slow  # negative control of the default-tier layout above
def test_tied_copies_without_their_gradient_sum_drift_apart(tmp_path, reference_run):
    worst = _check(*PP2, tmp_path, reference_run, fault="skip_tied_reduce")
    assert worst > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [
    ((3, ["parallel.llm.pp=1"]), (4, ["parallel.llm.pp=2"])),  # one parameter -> two copies
    ((6, ["parallel.llm.tp=2", "parallel.llm.pp=2"]), (3, ["parallel.llm.pp=1"])),  # two TP-split copies -> one
], ids=["pp1_to_pp2", "tp2_pp2_to_pp1"])
def test_a_tied_weight_resumes_under_another_layout(first, second, tmp_path, reference_run):
    """AdamW state of a tied weight saved as one parameter is found for both copies (and back)."""
    ref_losses, ref_params = reference_run(["optim.warmup_steps=5", "train.steps=6", TIE])
    step3 = first_three_steps(tmp_path, (first[0], [TIE, *first[1]]))
    losses, params, _ = resume(tmp_path, step3, (second[0], [TIE, *second[1]]), "b")
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    # Attention key biases get no gradient (softmax ignores a shift), so AdamW moves them by rounding
    # noise alone, which differs between layouts: left out here.
    kept = [k for k in ref_params if not k.endswith("k_proj.bias")]
    worst, where = max_param_mismatch({k: params[k] for k in kept}, {k: ref_params[k] for k in kept})
    assert worst < 1e-3, (worst, where)
    assert (params["llm/embed/embed_tokens.weight"] - params["llm/head/lm_head.weight"]).abs().max() < 1e-6


@pytest.mark.slow
def test_bf16_zero1_copies_of_a_tied_weight_stay_bit_identical(tmp_path):
    """DeepSpeed's bf16 optimizer keeps fp32 gradients and masters beside the weights: the copies'
    summed gradients must reach both, so after every step the two bf16 copies are the same bits."""
    _, params, _ = launch(tmp_path, 4, [STEPS, TIE, *PP2[1], "train.dtype=bf16", "deepspeed_config=ds_configs/zero1.json"])
    embed, head = params["llm/embed/embed_tokens.weight"], params["llm/head/lm_head.weight"]
    assert embed.dtype == torch.bfloat16 and torch.equal(embed, head)
    # Negative control: without the sum the copies part at the first step.
    _, bad, _ = launch(tmp_path / "neg", 4, [STEPS, TIE, *PP2[1], "train.dtype=bf16",
                                             "deepspeed_config=ds_configs/zero1.json"], fault="skip_tied_reduce")
    assert not torch.equal(bad["llm/embed/embed_tokens.weight"], bad["llm/head/lm_head.weight"])

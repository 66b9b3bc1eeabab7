"""Encoders on slices of their packed rows (``models/packed_tp.py``, tensor parallelism with
sequence-sharded activations: ViT, CLIP and SigLIP towers, Whisper) compute the unsharded encoder's
outputs and gradients on two real gloo ranks, items of mixed sizes with padding rows included; the
recipe rules that let encoders ask for it."""

from __future__ import annotations

import pytest
from rank_pool import run_ranks  # tests/ is on sys.path under pytest
from test_tp_sequence import _recipe, tp_overlap_on
from tp_seq_cases import WORLD
from tp_seq_vit_cases import CASES, MIXED, rows, vit_case

SLICED_VIT_GRAPHS = 4
"""Graphs of a compiled encoder block (ViT, CLIP, Whisper) on slices, between its four collectives and the per-image
attention (images grouped by length on the host, left out of graphs as in every block): the first
norm; the residual and the second norm; the MLP's activation; the last residual."""


def _vit_cases(rank: int, group, cases: list[tuple]) -> list[dict]:
    return [vit_case(rank, group, *c) for c in cases]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_ranks(_vit_cases, WORLD, CASES + [("vit", MIXED, 2, False)])


@pytest.mark.parametrize("i", range(len(CASES)), ids=["vit_mixed_chunks3", "vit_mixed_chunks1", "vit_equal_sizes",
                                                      "vit_no_image", "clip_mixed", "siglip_mixed", "whisper_clips"])
def test_encoders_on_slices_give_the_unsharded_output_and_every_gradient(runs, i):
    family, sizes, _ = CASES[i]
    between, out_rows = rows(family, sizes)
    for rank in range(WORLD):
        got = runs[rank][i]
        assert got["shape"] == (out_rows, 32)  # whole rows after the head, padding (and CLS) dropped
        assert got["sliced"] == -(-between // WORLD)  # between blocks: this rank's slice
        assert got["out_err"] < 1e-5
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5, abs=1e-6)
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"


def test_vit_on_slices_without_summing_replicated_gradients_over_tp_gets_norms_and_biases_wrong(runs):
    for rank in range(WORLD):
        got = runs[rank][len(CASES)]
        assert got["out_err"] < 1e-5  # the forward is unaffected
        # the replicated parameters on slices: norms, the row-parallel linears' biases
        assert got["grad_err"] > 1e-2 and any(k in got["where"] for k in ("layernorm", "o_proj.bias", "fc2.bias")), got


def _compiled(rank: int, group, family: str, sizes: tuple[int, ...]) -> dict:
    return vit_case(rank, group, family, sizes, 2, backend="aot_eager")


@pytest.mark.parametrize("family, sizes", [("vit", MIXED), pytest.param("clip", MIXED, marks=pytest.mark.slow),
                                           pytest.param("whisper", (12, 20, 14), marks=pytest.mark.slow)])
def test_compiled_encoder_blocks_on_slices_give_the_unsharded_output_and_every_gradient(family, sizes):
    runs = run_ranks(_compiled, WORLD, family, sizes)
    for rank in range(WORLD):
        got = runs[rank]
        assert got["out_err"] < 1e-5
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
        assert got["graphs"] == SLICED_VIT_GRAPHS, got["graphs"]


def test_tp_overlap_auto_turns_on_for_a_vit_encoder_on_cuda():
    r = _recipe("parallel.encoder.tp=2")
    assert tp_overlap_on(r, "encoder", cuda=True) and not tp_overlap_on(r, "encoder", cuda=False)
    assert tp_overlap_on(_recipe("parallel.encoder.tp=2", "parallel.encoder.tp_overlap=true"), "encoder", cuda=False)
    # Packed rows are padded per microbatch: no data.seq_len rule for an encoder.
    assert tp_overlap_on(_recipe("parallel.encoder.tp=2", "parallel.encoder.tp_overlap=true", "data.seq_len=65"),
                         "encoder", cuda=False)

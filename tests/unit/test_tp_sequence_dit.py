"""The DiT generator on sequence slices (``families/dit/sharded.py``, tensor parallelism with
sequence-sharded activations) computes the unsharded PixArt's output and gradients on two real gloo
ranks, the condition's gradient included; the recipe rules that let a DiT generator ask for it."""

from __future__ import annotations

import pytest
from rank_pool import run_ranks  # tests/ is on sys.path under pytest
from test_tp_sequence import REPO, tp_overlap_on
from tp_seq_cases import WORLD
from tp_seq_dit_cases import CASES, dit_case

from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe

SLICED_DIT_GRAPHS = 7
"""Graphs of a compiled DiT block on slices, between its six collectives (the modulation's and the
condition's gradient sums come first and make none): the modulation, first norm and q/k/v input; the
self-attention; the gated residual; the cross-attention (keys and values of the condition); the
residual, second norm and modulation; the GELU; the gated residual."""


def _dit_cases(rank: int, group, cases: list[tuple], hooks: bool) -> list[dict]:
    return [dit_case(rank, group, *c, hooks=hooks) for c in cases]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_ranks(_dit_cases, WORLD, CASES, True)


@pytest.mark.parametrize("i", range(len(CASES)), ids=["tokens64_chunks3", "tokens36_chunks1", "one_image"])
def test_dit_on_slices_gives_the_unsharded_output_and_every_gradient(runs, i):
    resolution, _, images = CASES[i]
    tokens = (resolution // 2) ** 2
    for rank in range(WORLD):
        got = runs[rank][i]
        assert got["sliced"] == (images, tokens // WORLD, 32)  # between blocks: this rank's slice of every image
        assert got["contiguous"]  # what a pipeline stage can send
        assert got["out_err"] < 1e-5
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5, abs=1e-6)
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
        assert got["cond_err"] < 1e-5  # what the output projector before the generator receives


def test_dit_on_slices_without_summing_replicated_gradients_over_tp_gets_tables_and_biases_wrong():
    runs = run_ranks(_dit_cases, WORLD, CASES[:1], False)
    for rank in range(WORLD):
        got = runs[rank][0]
        assert got["out_err"] < 1e-5  # the forward is unaffected
        # the replicated parameters on slices: the modulation table, the row-parallel linears' biases
        assert got["grad_err"] > 1e-2 and any(k in got["where"] for k in ("scale_shift_table", "to_out.0.bias",
                                                                         "net.2.bias")), got


def _compiled(rank: int, group) -> dict:
    return dit_case(rank, group, *CASES[0], backend="aot_eager")


def test_compiled_dit_blocks_on_slices_give_the_unsharded_output_and_every_gradient():
    runs = run_ranks(_compiled, WORLD)
    for rank in range(WORLD):
        got = runs[rank]
        assert got["out_err"] < 1e-5 and got["cond_err"] < 1e-5
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
        assert got["graphs"] == SLICED_DIT_GRAPHS, got["graphs"]


def _two_gen(*overrides: str):
    """tiny_two_gen, whose ``sketcher`` is a DiT of 8 x 8 px at patch 2: 16 patch tokens per image."""
    return load_recipe(REPO / "recipes" / "tiny_two_gen.yaml", ["layout=disaggregated", *overrides])


def test_tp_overlap_auto_turns_on_for_a_dit_generator_on_cuda_where_its_tokens_split():
    r = _two_gen("parallel.modules.sketcher.tp=2")
    assert tp_overlap_on(r, "sketcher", cuda=True) and not tp_overlap_on(r, "sketcher", cuda=False)
    assert tp_overlap_on(_two_gen("parallel.modules.sketcher.tp=2", "parallel.modules.sketcher.tp_overlap=true"),
                         "sketcher", cuda=False)
    assert not tp_overlap_on(_two_gen("parallel.modules.painter.tp=2"), "painter", cuda=True)  # unet: no path
    # At 6 x 6 px, 9 patch tokens do not split over 2 ranks: auto stays replicated, true is refused.
    odd = ("parallel.modules.sketcher.tp=2", "model.modules.sketcher.resolution=6")
    assert not tp_overlap_on(_two_gen(*odd), "sketcher", cuda=True)
    with pytest.raises(ConfigError, match=r"parallel\.modules\.sketcher\.tp_overlap.* 9 patch tokens .*tp 2"):
        _two_gen(*odd, "parallel.modules.sketcher.tp_overlap=true")

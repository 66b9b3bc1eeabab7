"""Tensor parallelism on sequence slices with overlapped collectives (``parallel/tp_sequence.py``)
computes the unsharded LLM's outputs and gradients, on two real gloo ranks; the recipe rules of
``parallel.<module>.tp_overlap``."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_pool import run_ranks  # tests/ is on sys.path under pytest
from tp_seq_cases import CASES, WORLD, B, S, case  # tests/ is on sys.path under pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.graph import module_parallel, sliced_tp_chunks
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.recipe.tp_overlap import tp_overlap_blocker

REPO = Path(__file__).resolve().parents[2]
SLICED_BLOCK_GRAPHS = 6
"""Graphs of a compiled decoder block on slices, between its four collectives: the input norm; the
projections' reshape and rotary up to the span attention (left out of graphs, as in every block); the
attention output's reshape; the residual and the second norm; SiLU(gate) * up; the last residual."""


def _cases(rank: int, group, names: list[str], hooks: bool) -> dict:
    return {name: case(rank, group, *CASES[name], hooks) for name in names}


def _two_ranks(names: list[str], hooks: bool) -> dict:
    return run_ranks(_cases, WORLD, names, hooks)


@pytest.fixture(scope="module")
def sharded_runs() -> dict:
    return _two_ranks(list(CASES), hooks=True)


@pytest.mark.parametrize("name", list(CASES))
def test_sequence_sharded_tp_gives_the_unsharded_loss_and_every_gradient(sharded_runs, name):
    for rank in range(WORLD):
        got = sharded_runs[rank][name]
        assert got["sliced"] == (B, S // WORLD, 32)
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5)
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"


def test_without_summing_replicated_gradients_over_tp_the_norm_weights_are_wrong():
    runs = _two_ranks(["llama_chunks1"], hooks=False)
    for rank in range(WORLD):
        got = runs[rank]["llama_chunks1"]
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5)  # the forward is unaffected
        assert got["grad_err"] > 1e-2 and "layernorm" in got["where"], got


def _compiled(rank: int, group, name: str, hooks: bool) -> dict:
    return case(rank, group, *CASES[name], hooks, backend="aot_eager")


@pytest.mark.parametrize("name", ["llama_chunks3", pytest.param("qwen2_chunks2", marks=pytest.mark.slow)])
def test_compiled_sliced_blocks_give_the_unsharded_loss_and_every_gradient(name):
    """Compiled training on slices: each decoder block compiles around its collectives (which run
    eagerly between its graphs) and still computes the unsharded layers' loss and gradients."""
    runs = run_ranks(_compiled, WORLD, name, True)
    for rank in range(WORLD):
        got = runs[rank]
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5)
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
        assert got["graphs"]["LlmBlock"] == SLICED_BLOCK_GRAPHS, got["graphs"]


def test_compiled_sliced_blocks_without_the_tp_gradient_sum_get_the_norm_weights_wrong():
    """Negative control: the compiled blocks' replicated weights are summed over TP by the same hooks."""
    runs = run_ranks(_compiled, WORLD, "llama_chunks3", False)
    for rank in range(WORLD):
        got = runs[rank]
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5)
        assert got["grad_err"] > 1e-2 and "layernorm" in got["where"], got


# --------------------------------------------------------------------------- recipe rules


def _recipe(*overrides: str):
    return load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["layout=disaggregated", *overrides])


def tp_overlap_on(r, name: str, cuda: bool) -> bool:
    """Whether the job runs module ``name`` on sequence slices at its own TP degree."""
    return sliced_tp_chunks(r, name, module_parallel(r, name).tp, cuda) > 0


def test_tp_overlap_auto_turns_on_for_the_llm_on_cuda_only_where_the_sequence_splits():
    r = _recipe("parallel.llm.tp=2")
    assert tp_overlap_on(r, "llm", cuda=True) and not tp_overlap_on(r, "llm", cuda=False)
    assert not tp_overlap_on(r, "encoder", cuda=True)  # tp 1
    assert not tp_overlap_on(_recipe("parallel.llm.tp=2", "parallel.llm.tp_overlap=false"), "llm", cuda=True)
    assert tp_overlap_on(_recipe("parallel.llm.tp=2", "parallel.llm.tp_overlap=true"), "llm", cuda=False)
    seq = _recipe("parallel.llm.tp=2").data.seq_len
    odd = _recipe("parallel.llm.tp=2", f"data.seq_len={seq + 1}")
    assert not tp_overlap_on(odd, "llm", cuda=True)  # auto: replicated activations where slices cannot be cut


@pytest.mark.parametrize("overrides, match", [
    (["parallel.generator.tp=2", "parallel.generator.tp_overlap=true", "model.generator.resolution=18"],
     "'parallel.generator.tp_overlap' tp 2 must divide the 81 tokens of a generated image"),
    (["parallel.llm.tp=2", "parallel.llm.tp_overlap=true", "data.seq_len=65"],
     "'parallel.llm.tp_overlap' data.seq_len 65 must be divisible by tp 2"),
    (["parallel.llm.tp=2", "parallel.llm.tp_overlap=true", "parallel.llm.tp_overlap_chunks=100", "data.seq_len=64"],
     "'parallel.llm.tp_overlap' 100 tp_overlap_chunks exceed the 32 positions"),
    (["parallel.llm.tp=2", "parallel.llm.tp_overlap=true", "parallel.llm.sp=2"],
     "'parallel.llm.tp_overlap' does not combine with sequence parallelism"),
    (["parallel.llm.tp_overlap_chunks=0"], "'parallel.llm.tp_overlap_chunks' must be an integer >= 1, got 0"),
])
def test_tp_overlap_where_it_cannot_apply_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _recipe(*overrides)


def test_a_family_without_a_path_on_slices_is_named():
    # Every built-in family has one; a plug-in family says so with Family.sliced_tp.
    refusal = "the conv3d family has no sequence-sharded tensor-parallel path"
    assert tp_overlap_blocker("conv3d", False, 1, 2, 4) == refusal
    assert tp_overlap_blocker("unet", True, 1, 2, 4, image_tokens=64) is None

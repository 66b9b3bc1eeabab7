"""Tensor parallelism on sequence slices on CUDA + NCCL (the LLM, encoders on their packed rows, the generators):
the collectives on the side stream, the GEMMs waiting on events, and the result equal to the
unsharded layers. Skipped without 2 GPUs."""

from __future__ import annotations

import pytest
import torch
from rank_pool import run_ranks  # tests/ is on sys.path under pytest
from tp_seq_cases import CASES, WORLD, case  # tests/ is on sys.path under pytest
from tp_seq_gen_cases import CASES as GEN_CASES
from tp_seq_gen_cases import generator_case
from tp_seq_vit_cases import CASES as VIT_CASES
from tp_seq_vit_cases import vit_case

pytestmark = pytest.mark.gpu


def _cases(rank: int, group, compiler: str | None) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs, compared at fp32 tolerance
    out = {name: case(rank, group, *CASES[name], True, device=f"cuda:{rank}", backend=compiler) for name in CASES}
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("compiler", [None, "inductor"])  # eager, and compiled around the collectives
def test_sequence_sharded_tp_on_nccl_gives_the_unsharded_loss_and_gradients(compiler):
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    runs = run_ranks(_cases, WORLD, compiler, backend="nccl", start="spawn", timeout=600)
    for rank, value in runs.items():
        for name, got in value.items():
            assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-4), name
            assert got["grad_err"] < 1e-4, f"{name} rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"


def _on_nccl(cases, fn, compiler: str | None) -> list[list[dict]]:
    """``fn(rank, group, *case, backend=compiler, device=...)`` for every case on two GPUs, each rank's results."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    return list(run_ranks(_run_cases, WORLD, cases, fn, compiler, backend="nccl", start="spawn", timeout=600).values())


def _run_cases(rank: int, group, cases, fn, compiler: str | None) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs and convolutions, compared at fp32 tolerance
    torch.backends.cudnn.allow_tf32 = False
    out = [fn(rank, group, *c, backend=compiler, device=f"cuda:{rank}") for c in cases]
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_a_vit_on_slices_on_nccl_gives_the_unsharded_output_and_gradients(compiler):
    for rank, value in enumerate(_on_nccl(VIT_CASES, vit_case, compiler)):
        for case_, got in zip(VIT_CASES, value):
            assert got["out_err"] < 1e-4, case_
            assert got["grad_err"] < 1e-4, f"{case_} rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_generators_on_slices_on_nccl_give_the_unsharded_output_and_gradients(compiler):
    for rank, value in enumerate(_on_nccl(GEN_CASES, generator_case, compiler)):
        for case_, got in zip(GEN_CASES, value):
            assert got["out_err"] < 1e-4 and got["cond_err"] < 1e-4, case_
            assert got["host_reads"] == ["__float__"], case_  # no device sync in the step, only the control's
            assert got["grad_err"] < 1e-4, f"{case_} rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"

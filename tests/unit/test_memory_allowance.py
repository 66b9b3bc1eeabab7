"""What a GPU rank holds beside its tensors (``estimate/gpu_allowance.py``): the figures, each rank's
NCCL connections, the launch-time check's one line, and the start-up check against free memory."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from disttrain_ds.cli import launch
from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate import gpu_allowance as ga
from disttrain_ds.estimate import memory, memory_check
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.entry import dry_run

MIB, GIB = 2**20, 2**30
TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml")
GPU = ["layout=disaggregated", "train.gpu_allowance=true"]  # tiny_cpu, priced as if on GPUs


@pytest.fixture(autouse=True)
def _no_nccl_env(monkeypatch):
    for key in ("NCCL_BUFFSIZE", "NCCL_NCHANNELS_PER_NET_PEER", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        monkeypatch.delenv(key, raising=False)


def test_figures_default_and_take_nccls_own_settings_from_the_environment():
    f = ga.AllowanceFigures()
    assert (f.nccl_buffsize, f.p2p_channels) == (4 * MIB, 2)  # NCCL's documented defaults
    assert ga.AllowanceFigures.from_env({}) == f
    env = {"NCCL_BUFFSIZE": str(2 * MIB), "NCCL_NCHANNELS_PER_NET_PEER": "4", "NCCL_MAX_NCHANNELS": "8"}
    got = ga.AllowanceFigures.from_env(env)
    assert (got.nccl_buffsize, got.p2p_channels, got.collective_channels) == (2 * MIB, 4, 8)
    assert ga.AllowanceFigures.from_env({"NCCL_MIN_NCHANNELS": "32"}).collective_channels == 32
    # NCCL warns and keeps its default for a value it cannot read; so does the allowance.
    assert ga.AllowanceFigures.from_env({"NCCL_BUFFSIZE": "lots", "NCCL_MAX_NCHANNELS": "0"}) == f


def test_one_ranks_allowance_is_context_nccl_connections_and_a_fraction_of_the_estimate():
    f = ga.AllowanceFigures()
    links = ga.NcclLinks(collectives=2, p2p=3)
    # A ring keeps a send and a receive connection per channel; a p2p direction one per channel.
    assert ga.nccl_bytes(links, f) == 4 * MIB * (2 * 16 * 2 + 2 * 3)
    a = ga.allowance(40 * GIB, links, f)
    assert a.context == f.cuda_context + f.workspaces == 896 * MIB
    assert a.fragmentation == pytest.approx(0.05 * 40 * GIB)
    assert a.total == a.context + a.nccl + a.fragmentation
    assert a.describe() == "allowance 3.1 GiB (context 0.9 GiB, NCCL 0.3 GiB, fragmentation 2.0 GiB)"
    assert ga.nccl_bytes(ga.NcclLinks(0, 0), f) == 0


def test_each_rank_counts_its_collective_groups_and_point_to_point_directions():
    # encoder 0 | llm stages 1, 2 | generator 3; every module runs backward (all train).
    links = ga.rank_links(load_recipe(TINY, ["layout=disaggregated", "parallel.llm.pp=2"]))
    assert links == {0: ga.NcclLinks(0, 2),  # activations to the LLM, gradients back
                     1: ga.NcclLinks(1, 4),  # pipeline group; stage 2 both ways, the encoder both ways
                     2: ga.NcclLinks(1, 4),
                     3: ga.NcclLinks(0, 2)}
    dp = ga.rank_links(load_recipe(TINY, ["layout=disaggregated", "parallel.llm.pp=1", "parallel.llm.dp=2"]))
    assert dp[1].collectives == 1 and dp[2].collectives == 1  # the LLM's DP group
    assert ga.rank_links(load_recipe(TINY)) == {0: ga.NcclLinks(0, 0)}  # reference: one process, no NCCL


def test_the_allowance_is_off_for_cpu_recipes_and_against_host_ram():
    rows_recipe = load_recipe(TINY, ["layout=disaggregated"])
    rows = memory.estimate(rows_recipe)
    assert not rows_recipe.train.gpu_allowance  # tiny_cpu says it is a CPU recipe
    assert memory_check.per_rank_needs(rows_recipe, rows) == memory.per_rank_totals(rows)
    gpu = load_recipe(TINY, GPU)
    needs, totals = memory_check.per_rank_needs(gpu, rows), memory.per_rank_totals(rows)
    assert all(needs[r] > totals[r] + 896 * MIB - 1 for r in totals)
    assert memory_check.per_rank_needs(gpu, rows, gpu=False) == totals  # a share of host RAM: no CUDA context
    memory_check.check_fits(gpu, rows, 0.5, "host RAM", gpu=False)


def test_a_rank_that_fits_its_tensors_but_not_its_allowance_is_one_line_with_the_breakdown():
    recipe = load_recipe(TINY, GPU)
    rows = memory.estimate(recipe)
    memory_check.check_fits(recipe, rows, 2.0, "train.device_memory_gib")
    with pytest.raises(ConfigError) as exc:
        memory_check.check_fits(recipe, rows, 0.5, "train.device_memory_gib")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{recipe.source_file}: rank ")
    assert " does not fit: estimate " in msg and " + allowance " in msg
    assert "(context 0.9 GiB, NCCL " in msg and "> 0.5 GiB (train.device_memory_gib)" in msg


def test_dry_run_shows_the_largest_ranks_allowance(capsys):
    lines: list[str] = []
    assert dry_run(TINY, [*GPU, "train.device_memory_gib=8"], out=lines.append) == 0
    largest = next(line for line in lines if line.startswith("largest: rank "))
    assert "+ allowance " in largest and "(context 0.9 GiB" in largest and "of 8.0 GiB" in largest


@pytest.fixture
def launch_run(run_main):
    return functools.partial(run_main, launch.main)


def test_disttrain_launch_holds_estimate_plus_allowance_to_device_memory(launch_run, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    argv = ["--hostfile", str(hostfile), "--dry-run", "--recipe", TINY, *GPU]
    code, out, err = launch_run(*argv, "train.device_memory_gib=0.5")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "+ allowance " in err and "> 0.5 GiB (train.device_memory_gib)" in err
    code, out, _ = launch_run(*argv, "train.device_memory_gib=8")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("memory: "))
    assert line.startswith("memory: estimated peak ") and "+ allowance " in line
    assert line.endswith("of 8 GiB per device: fits")


def test_startup_check_against_free_memory_counts_what_is_still_to_come():
    recipe = load_recipe(TINY, [*GPU, "parallel.llm.pp=2"])
    rows = memory.estimate(recipe)
    est = memory.per_rank_totals(rows)[1]
    f = ga.AllowanceFigures()
    to_come = f.workspaces + ga.nccl_bytes(ga.NcclLinks(1, 4), f) + f.fragmentation * est
    assert memory_check.startup_memory_problem(recipe, rows, 1, int(est + to_come) + 1, 80 * GIB, f) is None
    line = memory_check.startup_memory_problem(recipe, rows, 1, int(est + to_come) - 1, 80 * GIB, f)
    assert line is not None and "\n" not in line
    assert line.startswith(f"{recipe.source_file}: rank 1 (llm stage 0) does not fit its GPU: estimate ")
    assert "+ allowance still to come " in line and "(workspaces 0.1 GiB, NCCL 0.2 GiB, fragmentation" in line
    assert "free of 80.0 GiB" in line and "already in use" in line
    # The context is already outside what is free: it is not counted twice.
    assert "context" not in line.split("already in use")[0]
    off = load_recipe(TINY, ["layout=disaggregated", "parallel.llm.pp=2"])  # train.gpu_allowance false
    assert memory_check.startup_memory_problem(off, rows, 1, int(est) + 1, 80 * GIB, f) is None
    assert "allowance" not in memory_check.startup_memory_problem(off, rows, 1, int(est) - 1, 80 * GIB, f)

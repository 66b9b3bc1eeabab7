"""Rank maps: disjoint contiguous module ranges, DeepSpeed-style coordinates, world checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain_ds.comm.routes import blocks
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.topology import ModuleGrid

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"


def test_tiny_disaggregated_layout_is_encoder1_llm_pp2_generator1():
    topo = topology_of(load_recipe(TINY, ["layout=disaggregated"]))
    assert topo.world_size == 4
    assert [(m.name, list(m.ranks)) for m in topo.modules] == [
        ("encoder", [0]),
        ("llm", [1, 2]),
        ("generator", [3]),
    ]
    assert topo.total_stages == 4 and topo.stage_offset("generator") == 3


@pytest.mark.parametrize(
    "overrides, sizes",
    [
        (["parallel.encoder.dp=2", "parallel.llm.dp=1", "parallel.llm.pp=2", "train.micro_batch=2"], [2, 2, 1]),
        (["parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2"], [1, 2, 2]),
    ],
)
def test_five_rank_layouts(overrides, sizes):
    topo = topology_of(load_recipe(TINY, ["layout=disaggregated", *overrides]))
    assert [m.size for m in topo.modules] == sizes and topo.world_size == 5
    seen = [r for m in topo.modules for r in m.ranks]
    assert seen == list(range(5))


def test_monolithic_gives_encoder_and_generator_the_llm_dp():
    topo = topology_of(load_recipe(TINY, ["layout=monolithic", "parallel.llm.dp=2", "parallel.llm.pp=1"]))
    assert [(m.dp, m.pp) for m in topo.modules] == [(2, 1), (2, 1), (2, 1)]


def test_coordinates_round_trip_like_deepspeed_pipe_data_model_axes():
    g = ModuleGrid("llm", first_rank=3, dp=2, pp=3, tp=2)
    for r in g.ranks:
        s, d, t = g.coords(r)
        assert g.rank(stage=s, dp=d, tp=t) == r
    assert g.rank(stage=1, dp=0, tp=0) == 3 + 4  # pipe is the slowest axis
    assert g.dp_group(stage=0) == [3, 5]


def test_world_size_mismatch_is_one_line_error():
    topo = topology_of(load_recipe(TINY, ["layout=disaggregated"]))
    with pytest.raises(ConfigError, match="needs 4 ranks .* but the job has 3"):
        topo.check_world(3, "tiny_cpu.yaml")


def test_slot_blocks_are_contiguous_and_cover_the_slot():
    parts = blocks(6, 3)
    assert [list(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError):
        blocks(6, 4)

"""Tensor-parallel sharding helpers and the recipe checks that refuse degrees a model cannot split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.parallel.tensor_parallel import (
    ColumnParallelConv2d,
    RowParallelConv2d,
    TPContext,
    shard_layer,
    shard_rows,
    unshard_rows,
)
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


@pytest.mark.parametrize("size, pieces", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_row_shards_reassemble_to_the_full_tensor(size, pieces):
    t = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * pieces * 2, -1)
    shards = [shard_rows(t, r, size, pieces) for r in range(size)]
    assert all(s.shape[0] == t.shape[0] // size for s in shards)
    assert unshard_rows(shards, pieces).equal(t)


def test_stacked_projection_is_split_within_each_half():
    # GEGLU stacks (hidden, gate): rank r must get rows r of both halves, not one half only.
    t = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0], [11.0], [12.0], [13.0]])
    assert shard_rows(t, 0, 2, pieces=2).flatten().tolist() == [0, 1, 10, 11]
    assert shard_rows(t, 1, 2, pieces=2).flatten().tolist() == [2, 3, 12, 13]


def test_tp_degree_one_leaves_a_layer_untouched():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert shard_layer(layer, TPContext(None, 0, 1)) is layer
    assert isinstance(layer[0], torch.nn.Linear)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["layout=disaggregated", "parallel.llm.tp=8"], "'model.llm.heads'"),
        (["layout=disaggregated", "parallel.llm.tp=4"], "'model.llm.kv_heads'"),
        (["layout=disaggregated", "parallel.encoder.tp=4"], "'model.encoder.heads'"),
        (["layout=disaggregated", "parallel.generator.tp=8", "model.generator.attention_head_dim=[8,4]"],
         "'model.generator.attention_head_dim[1]'"),
        # Monolithic: the encoder and generator stages take the LLM's TP degree.
        (["layout=monolithic", "parallel.llm.tp=4"], "'model.encoder.heads'"),
    ],
)
def test_tp_degree_that_does_not_split_the_model_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, overrides)
    msg = str(err.value)
    assert key in msg and "tiny_cpu.yaml" in msg and "\n" not in msg


def test_reference_layout_ignores_tp_degrees():
    # The single-process reference computes unsharded; its degrees only matter for other layouts.
    assert load_recipe(TINY, ["parallel.llm.tp=8"]).parallel.llm.tp == 8


def test_splittable_tp_degrees_load():
    r = load_recipe(TINY, ["layout=disaggregated", "parallel.llm.tp=2", "parallel.encoder.tp=2",
                           "parallel.generator.tp=2"])
    assert (r.parallel.encoder.tp, r.parallel.llm.tp, r.parallel.generator.tp) == (2, 2, 2)


@pytest.mark.parametrize("conv, style", [
    (torch.nn.Conv2d(3, 4, 3), "row"),  # 3 input channels over 2 ranks
    (torch.nn.Conv2d(4, 4, 3, groups=2), "col"),  # grouped: each group reads its own channels
    (torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), "col"),  # F.conv2d pads with zeros
])
def test_a_convolution_the_channel_split_does_not_compute_is_refused_in_one_line(conv, style):
    split = ColumnParallelConv2d if style == "col" else RowParallelConv2d
    with pytest.raises(ValueError, match=r"^a convolution over \d+ channels .* does not split over tensor-parallel"):
        split(conv, TPContext(None, 0, 2))

"""Per-host reading (``data.read: host``): which units each host reads, parts on whole columns,
counts summed over hosts, batch files with holes, data states merged from the hosts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.host_read import (
    aligned_parts,
    column_positions,
    host_names,
    merge_states,
    plan_reading,
    rank_positions,
    slot_columns,
)
from disttrain_ds.data.outline import outline, stand_in
from disttrain_ds.data.producers import build_source
from disttrain_ds.metrics.step_flops import StepFlopsCounter
from disttrain_ds.mllm.model import BatchNorms
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.samples import GenShape, ShapeSpec, batch_bytes
from disttrain_ds.topology import ModuleGrid

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))


def grids(dps: dict[str, int]) -> list[ModuleGrid]:
    """One stage per module, modules on consecutive ranks (the disaggregated rank map)."""
    out, first = [], 0
    for name, dp in dps.items():
        out.append(ModuleGrid(name, first, dp=dp, pp=1))
        first += dp
    return out


def test_column_positions_put_each_part_on_the_same_block_of_every_slot():
    # 8 samples, slots of 4, two columns: part-concatenated order runs column 0 of slot 0, of slot 1, ...
    assert column_positions(8, 4, 2) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert column_positions(8, 4, 1) == list(range(8))  # one column: part-major, as before
    assert slot_columns([2, 4, 1]) == 4


def test_two_hosts_each_holding_one_replica_of_every_module_read_disjoint_halves():
    modules = grids({"encoder": 2, "llm": 2, "generator": 2})  # ranks 0-1, 2-3, 4-5
    hosts = ["a", "b", "a", "b", "a", "b"]
    consumed = rank_positions(modules, slot=4, batch=8)
    assert consumed[0] == consumed[2] == consumed[4] == {0, 1, 4, 5}
    order = column_positions(8, 4, 2)
    plan = plan_reading([order[:4], order[4:]], hosts, consumed, 8)
    assert plan.units == {"a": (0,), "b": (1,)}
    assert plan.positions_of(0) == [0, 1, 4, 5] and plan.positions_of(1) == [2, 3, 6, 7]
    assert plan.positions_of(2) == []  # rank 2 reads the same samples as rank 0: counted once, by rank 0


def test_a_part_holding_two_hosts_samples_is_refused_and_the_fitting_part_count_named():
    modules = grids({"encoder": 2, "llm": 2, "generator": 2})
    hosts = ["a", "b", "a", "b", "a", "b"]
    consumed = rank_positions(modules, slot=4, batch=8)
    whole = [list(range(8))]  # one part: both hosts' samples
    with pytest.raises(ValueError, match=r"unit 0 holds samples of hosts \['a'\] and of hosts \['b'\]"):
        plan_reading(whole, hosts, consumed, 8)
    assert aligned_parts(8, 4, 2, hosts, consumed) == 2


def test_hosts_sharing_a_module_replica_both_read_its_samples():
    # The encoder (dp 1) sits on host a, the LLM's two replicas on a and b: a reads everything, b half.
    modules = grids({"encoder": 1, "llm": 2, "generator": 2})
    hosts = ["a", "a", "b", "a", "b"]
    consumed = rank_positions(modules, slot=2, batch=4)
    plan = plan_reading([[p] for p in range(4)], hosts, consumed, 4)
    assert plan.units == {"a": (0, 1, 2, 3), "b": (1, 3)}
    assert plan.contributor == (0, 0, 0, 0)  # each counted once, by host a's first rank


def test_emulated_host_names_are_one_per_rank():
    assert host_names(["m", "m"], "x, y") == ["m#x", "m#y"]
    assert host_names(["m", "m"], None) == ["m", "m"]
    with pytest.raises(ValueError, match="DISTTRAIN_EMULATED_HOSTS: names 1 hosts for 2 ranks"):
        host_names(["m", "m"], "x")


def test_norm_counts_summed_over_hosts_equal_the_whole_batch_norms():
    source = build_source(DataConfig(), SHAPE, 6, 5)
    batch = source.global_batch(0)
    halves = [BatchNorms.counts(batch[:2], 1), BatchNorms.counts(batch[2:], 1)]
    summed = BatchNorms.of_counts([a + b for a, b in zip(*halves)], 3)
    assert summed == BatchNorms.of(batch, 3)
    assert BatchNorms.of_counts(halves[0], 3) != BatchNorms.of(batch, 3)  # one host's share alone is not


def test_stand_ins_give_the_figures_of_the_samples_they_outline():
    source = build_source(DataConfig(), SHAPE, 4, 9)
    batch = source.global_batch(1)
    stand = [stand_in(outline(s, source.special), source.special) for s in batch]
    assert batch_bytes(stand) == batch_bytes(batch)
    assert [s.stats(8, source.special) for s in stand] == [s.stats(8, source.special) for s in batch]
    pad = source.special.pad
    assert [int((s.input_ids != pad).sum()) for s in stand] == [int((s.input_ids != pad).sum()) for s in batch]
    assert all(im.stride() == (0, 0, 0) for s in stand for im in s.images)  # no pixel memory


def test_a_host_reads_only_its_units_in_process_and_through_producers():
    cfg = DataConfig(max_images=2)
    whole = build_source(cfg, SHAPE, 4, 3).global_batch(2)
    for producers in (0, 1):
        with build_source(dataclasses.replace(cfg, producers=producers, queue_depth=1), SHAPE, 4, 3) as source:
            source.read_only((1, 3))
            got = source.global_batch(2)
        assert [s is None for s in got] == [True, False, True, False]
        for p in (1, 3):
            assert torch.equal(got[p].input_ids, whole[p].input_ids)
            assert all(torch.equal(a, b) for a, b in zip(got[p].images, whole[p].images))


@pytest.mark.parametrize("producers", [0, 1])
def test_a_share_is_read_unreordered_and_passed_through_the_host_order(producers):
    whole = build_source(DataConfig(), SHAPE, 4, 3).global_batch(2)
    with build_source(DataConfig(reorder=True, producers=producers, queue_depth=1), SHAPE, 4, 3) as source:
        source.read_only((0, 2))
        got = source.global_batch(2)
        assert [s is None for s in got] == [False, True, False, True]
        assert all(torch.equal(got[p].input_ids, whole[p].input_ids) for p in (0, 2))
        source.order_with(lambda samples: samples[2:] + samples[:2])
        assert [s.sample_id if s else None for s in source.global_batch(2)] == [whole[2].sample_id, None,
                                                                                 whole[0].sample_id, None]


def test_merged_state_takes_each_part_from_the_host_that_read_it():
    a = {"next_step": 3, "inner": {"kind": "parts", "parts": [{"kind": "records", "next_step": 3, "c": "a"},
                                                                {"kind": "unread", "next_step": 0}]}}
    b = {"next_step": 3, "inner": {"kind": "parts", "parts": [{"kind": "unread", "next_step": 0},
                                                                {"kind": "records", "next_step": 3, "c": "b"}]}}
    merged = merge_states([a, b])
    assert [p.get("c") for p in merged["inner"]["parts"]] == ["a", "b"]
    assert merge_states([{"next_step": 2, "inner": {}}]) == {"next_step": 2, "inner": {}}


def test_step_flops_of_stand_ins_equal_those_of_the_samples():
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe("tiny_cpu", [])
    source, spec = build_data_and_spec(recipe)
    batch = source.global_batch(0)
    count = StepFlopsCounter(spec)
    stand = [stand_in(outline(s, spec.special), spec.special) for s in batch]
    assert count(stand) == count(batch)


def _two_hosts_recipe(tmp_path, *overrides):
    from disttrain_ds.recipe.schema import load_recipe

    layout = ["layout=disaggregated", "parallel.encoder.dp=2", "parallel.llm.dp=2", "parallel.llm.pp=1",
              "parallel.generator.dp=2", f"logging.dir={tmp_path}"]
    return load_recipe("tiny_cpu", [*layout, *overrides])


def _read_by_host(recipe, log=print, ordered: list | None = None):
    from disttrain_ds.runtime.distributed import read_by_host
    from disttrain_ds.runtime.setup import build_data_and_spec

    source, _ = build_data_and_spec(recipe)
    with source:
        got = read_by_host(recipe, topology_of(recipe), source, 0, ["a", "b"] * 3, None, log), source.host_units
        if ordered is not None:
            ordered.append(source._order)
        return got


def _tar_shards(root, shards: int = 2):
    import io
    import tarfile

    from PIL import Image

    root.mkdir()
    for s in range(shards):
        with tarfile.open(root / f"{s}.tar", "w") as tf:
            for i in range(4):
                buf = io.BytesIO()
                Image.new("RGB", (32, 32), (60 * s, 40 * i, 90)).save(buf, "JPEG")
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"image {i} of shard {s}".encode())):
                    info = tarfile.TarInfo(f"{s}{i:03d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return str(root)


def test_each_host_gets_its_units_and_counts_once(tmp_path):
    counted, units = _read_by_host(_two_hosts_recipe(tmp_path))
    assert counted == [0, 2] and units == (0, 2)  # rank 0 (host a) reads and counts its DP block of both slots


def test_per_host_reading_refuses_what_would_read_other_hosts_samples(tmp_path):
    from disttrain_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="'data.read' host: data.source paper_stats reads each global batch as one stream"):
        _read_by_host(_two_hosts_recipe(tmp_path, "data.read=host", "data.source=paper_stats"))
    shards = [f"data.path={_tar_shards(tmp_path / 'shards')}", "data.source=webdataset",
              f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ConfigError, match=r"'data.shard_parts' 1 part do not fall on whole hosts .*; 2 parts would"):
        _read_by_host(_two_hosts_recipe(tmp_path, "data.read=host", *shards))
    counted, units = _read_by_host(_two_hosts_recipe(tmp_path, *shards, "data.shard_parts=2"))
    assert counted == [0, 2] and units == (0,)
    assert _read_by_host(_two_hosts_recipe(tmp_path, "data.reorder=true", "data.read=all")) == (None, None)


def test_auto_reads_per_host_where_it_can_and_says_why_every_host_reads_whole_batches_elsewhere(tmp_path):
    lines = []
    assert _read_by_host(_two_hosts_recipe(tmp_path), lines.append) == ([0, 2], (0, 2)) and lines == []
    for override, why in (("data.source=paper_stats", "data.source paper_stats reads each global batch as one stream"),):
        lines.clear()
        assert _read_by_host(_two_hosts_recipe(tmp_path, override), lines.append) == (None, None)
        assert lines == [f"data.read auto: every host reads whole global batches ({why}, so every host would read all "
                         "of it)" if "stream" in why else f"data.read auto: every host reads whole global batches ({why})"]


def test_reordering_reads_per_host_and_orders_each_batch_with_the_other_hosts_costs(tmp_path):
    from disttrain_ds.reorder.host_order import HostOrder

    for read in ("auto", "host"):
        lines, ordered = [], []
        got = _read_by_host(_two_hosts_recipe(tmp_path, "data.reorder=true", f"data.read={read}"), lines.append, ordered)
        assert got == ([0, 2], (0, 2)) and lines == []
        order = ordered[0]
        assert isinstance(order, HostOrder) and order.labels == [0, 1, 0, 1] and order.counted == [0, 2]

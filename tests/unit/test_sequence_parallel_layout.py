"""Where sequence-parallel ranks sit, which groups they get, and which recipes may ask for SP (pure)."""

from __future__ import annotations

import pytest
import torch

from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate.memory import estimate
from disttrain_ds.parallel.grid import SEQ, grid_groups
from disttrain_ds.parallel.groups import plan_groups
from disttrain_ds.parallel.sequence_parallel import SPContext
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.topology import ModuleGrid

SP2 = ["layout=disaggregated", "parallel.llm.pp=1", "parallel.llm.sp=2"]


def test_sp_ranks_sit_in_the_data_axis_replica_major_with_tp_fastest():
    g = ModuleGrid("llm", first_rank=2, dp=2, pp=2, tp=2, sp=2)
    assert g.size == 16 and g.data_size == 4
    seen = set()
    for r in g.ranks:
        stage, data, tp = g.data_coords(r)
        s, d, t = g.coords(r)
        assert (s, t) == (stage, tp) and d == data // 2 and g.sp_index(r) == data % 2
        assert g.rank(stage=s, dp=d, tp=t, sp=g.sp_index(r)) == r
        seen.add((s, d, t, g.sp_index(r)))
    assert len(seen) == 16
    assert g.rank(stage=0, dp=0, tp=0, sp=1) == 2 + 2  # one TP group further on
    assert g.rank(stage=0, dp=1, tp=0, sp=0) == 2 + 4  # the next replica after its SP ranks


def test_sp_groups_and_tp_groups_each_partition_the_module():
    g = ModuleGrid("llm", first_rank=1, dp=2, pp=2, tp=2, sp=2)
    for groups, size in ((g.sp_groups(), 2), (g.tp_groups(), 2)):
        flat = sorted(r for grp in groups for r in grp)
        assert flat == list(g.ranks) and all(len(grp) == size for grp in groups)
    for grp in g.sp_groups():  # one replica, stage and TP index; every slice once
        assert len({g.coords(r) for r in grp}) == 1 and sorted(g.sp_index(r) for r in grp) == [0, 1]


def test_deepspeed_data_axis_holds_dp_times_sp_ranks():
    g = ModuleGrid("llm", first_rank=0, dp=2, pp=1, tp=1, sp=2)
    lists = grid_groups(g)
    assert lists["data"] == [[0, 1, 2, 3]]
    assert len(lists["replica"]) == 4


def test_group_plan_adds_seq_groups_only_with_sp_and_channels_reach_only_sp_leads():
    topo = topology_of(load_recipe("tiny_cpu", SP2))
    specs = plan_groups(topo.modules, topo.world_size, frozenset(), topo.edges)
    llm = topo.module("llm")
    seq = [s for s in specs if len(s.key) == 3 and s.key[1] == SEQ]
    assert [s.ranks for s in seq] == [tuple(r) for r in llm.sp_groups()] == [(1, 2)]
    for s in specs:
        if s.key[0] == "channel":
            assert not set(s.ranks) & {r for r in llm.ranks if llm.sp_index(r) > 0}, s
    plain = topology_of(load_recipe("tiny_cpu", ["layout=disaggregated"]))
    assert not [s for s in plan_groups(plain.modules, plain.world_size, frozenset(), plain.edges) if SEQ in s.key]


def test_topology_of_an_sp_recipe_counts_its_ranks_and_says_sp():
    topo = topology_of(load_recipe("tiny_cpu", SP2))
    assert topo.world_size == 4 and topo.module("llm").sp == 2
    assert "sp=2" in topo.describe()


@pytest.mark.parametrize("overrides, key, words", [
    (["parallel.generator.sp=2"], "parallel.generator.sp", "unet family has no sequence-parallel path"),
    (["parallel.encoder.sp=auto", "parallel.encoder.dp=4", "train.micro_batch=4"], "parallel.encoder.sp",
     "heads per TP rank (2 / tp 1) must be divisible by sp 4"),  # a group may span every replica
    (["parallel.encoder.sp=auto", "parallel.encoder.dp=3", "train.micro_batch=3", "train.global_batch=3"],
     "parallel.encoder.sp", "auto needs parallel.encoder.dp a power of two"),
    (["parallel.encoder.sp=4"], "parallel.encoder.sp", "heads per TP rank (2 / tp 1)"),
    (["layout=monolithic", "parallel.llm.sp=2"], "parallel.llm.sp", "needs layout disaggregated"),
    (["parallel.llm.sp=0"], "parallel.llm.sp", "must be >= 1"),
    (["parallel.llm.sp=8"], "parallel.llm.sp", "heads per TP rank"),
    (["parallel.llm.sp=4", "model.llm.kv_heads=6", "model.llm.heads=12", "model.llm.hidden_size=96"],
     "parallel.llm.sp", "kv_heads per TP rank"),
    (["parallel.llm.sp=2", "data.seq_len=127"], "parallel.llm.sp", "seq_len 127"),
    (["parallel.llm.sp=auto", "parallel.llm.dp=4", "train.global_batch=4", "emulate.enabled=true"], "emulate.enabled", "adaptive SP"),
])
def test_sp_the_runtime_cannot_run_is_refused_in_one_line(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny_cpu", ["layout=disaggregated", *overrides])
    msg = str(e.value)
    assert "\n" not in msg and f"'{key}'" in msg and words in msg, msg


def test_an_encoder_takes_adaptive_groups_over_its_replicas():
    r = load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.encoder.sp=auto", "parallel.encoder.dp=4",
                                 "train.micro_batch=4", "model.encoder.heads=4"])
    enc = topology_of(r).module("encoder")
    assert enc.sp_auto and enc.sp == 1 and enc.dp == 4 and "sp=auto" in topology_of(r).describe()


def test_an_encoder_at_sp_pads_its_rows_so_seq_len_need_not_divide():
    r = load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.encoder.sp=2", "data.seq_len=127"])
    assert topology_of(r).module("encoder").sp == 2


def test_kv_heads_fewer_than_sp_ranks_are_accepted():
    load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.llm.sp=4", "parallel.llm.pp=1"])  # kv_heads 2 < sp 4


def test_memory_estimate_keeps_a_slice_of_every_sequence_per_sp_rank():
    one = {r.module: r for r in estimate(load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.llm.pp=1"]))}
    two = {r.module: r for r in estimate(load_recipe("tiny_cpu", SP2))}
    a, b = one["llm"].activations, two["llm"].activations
    assert a / 2 < b < a, (a, b)  # halved, but for the inputs every SP rank receives whole
    assert list(two["llm"].ranks) == [1, 2]
    assert two["encoder"].activations == one["encoder"].activations
    enc = {r.module: r for r in estimate(load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.encoder.sp=2"]))}
    a, b = one["encoder"].activations, enc["encoder"].activations
    assert a / 2 < b < a and list(enc["encoder"].ranks) == [0, 1], (a, b)  # an encoder's rows too


def test_sp_context_shards_contiguous_slices_and_refuses_an_uneven_split():
    x = torch.arange(24).view(2, 12)
    parts = [SPContext(None, r, 3).shard(x) for r in range(3)]
    assert torch.equal(torch.cat(parts, dim=1), x)
    with pytest.raises(ValueError, match="not divisible by sp 5"):
        SPContext(None, 0, 5).shard(x)


def test_a_checkpoint_from_before_sp_existed_resumes_in_the_same_layout():
    from disttrain_ds.checkpoint.manifest import fingerprint, layout_changes

    recipe = load_recipe("tiny_cpu", ["layout=disaggregated"])
    old = fingerprint(recipe, 4)
    for m in old["parallel"].values():  # the three-module form: one section per module
        m.pop("sp")
    assert layout_changes({"fingerprint": old}, recipe, 4) == []
    moved = layout_changes({"fingerprint": old}, load_recipe("tiny_cpu", SP2), 4)
    assert any("sp" in m for m in moved), moved


@pytest.mark.parametrize("overrides, words", [
    (["data.max_seq_len=200"], "multiple of seq_len 128"),
    (["data.max_seq_len=64"], "multiple of seq_len 128"),
    (["data.max_seq_len=256"], "not synthetic"),
])
def test_max_seq_len_the_data_cannot_make_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny_cpu", overrides)
    assert "\n" not in str(e.value) and "'data.max_seq_len'" in str(e.value) and words in str(e.value), str(e.value)


def test_memory_estimate_prices_every_sample_at_max_seq_len(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"segments": [{"text": "a short document"}]}\n')
    base = ["layout=disaggregated", "data.source=local", f"data.path={path}", "model.generator.in_channels=3"]
    one = {r.module: r for r in estimate(load_recipe("tiny_cpu", base))}
    four = {r.module: r for r in estimate(load_recipe("tiny_cpu", [*base, "data.max_seq_len=512"]))}
    assert four["llm"].activations > 3 * one["llm"].activations


AUTO = ["layout=disaggregated", "parallel.llm.pp=1", "parallel.llm.dp=4", "parallel.llm.sp=auto"]


def test_adaptive_sp_makes_every_aligned_group_once_on_every_rank():
    topo = topology_of(load_recipe("tiny_cpu", AUTO))
    llm = topo.module("llm")
    assert (llm.dp, llm.sp, llm.sp_auto, llm.size) == (4, 1, True, 4) and "sp=auto" in topo.describe()
    got = [(first, size, tuple(r)) for (first, size), r in llm.adaptive_groups()]
    assert got == [(0, 2, (1, 2)), (2, 2, (3, 4)), (0, 4, (1, 2, 3, 4))]
    specs = plan_groups(topo.modules, topo.world_size, frozenset(), topo.edges)
    seq = [s for s in specs if len(s.key) == 3 and s.key[1] == SEQ]
    assert [s.ranks for s in seq] == [(1, 2), (3, 4), (1, 2, 3, 4)]


@pytest.mark.parametrize("overrides, words", [
    (["parallel.llm.dp=3", "train.global_batch=6"], "power of two"),
    (["parallel.sp_bandwidth_gbs=[100]"], "inside a node, across nodes"),
])
def test_adaptive_sp_the_runtime_cannot_run_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny_cpu", [*AUTO, *overrides])
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)

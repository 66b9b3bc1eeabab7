"""Re-sharding a checkpoint for another layout: the pure pieces (TP joins and cuts, DP partitions,
torch optimizer state) and the resume checks, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepspeed.utils.tensor_fragment import fragment_address

from disttrain_ds.checkpoint.manifest import _check_usable, fingerprint, layout_changes
from disttrain_ds.checkpoint.reshard import (
    ReshardError,
    cut_tp,
    files_fit,
    join_tp,
    read_module,
    torch_optimizer_states,
    zero_states,
)
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("split", [[0, 1], [0, 2], [1, 1], None])  # rows, stacked halves, columns, replicated
@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_tp_shards_joined_then_cut_for_another_degree_are_that_degrees_shards(split, old, new):
    full = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
    shards = [cut_tp(full, split, r, old) for r in range(old)]
    assert torch.equal(join_tp(shards, split), full)
    if split is not None and old > 1:
        assert shards[0].shape != full.shape
    again = [cut_tp(join_tp(shards, split), split, r, new) for r in range(new)]
    assert torch.equal(join_tp(again, split), full)


def test_stacked_halves_are_split_within_each_half():
    full = torch.arange(8.0).view(8, 1)  # GEGLU: rows 0-3 hidden, 4-7 gate
    assert cut_tp(full, [0, 2], 0, 2).flatten().tolist() == [0, 1, 4, 5]


def zero_partition(flat: torch.Tensor, names: dict[str, int], dp: int, rank: int, step: float) -> dict:
    """A ZeRO-1 state of DP rank ``rank``: its slice of the padded flat group, with the fragment
    addresses DeepSpeed records (parameter pieces inside the partition)."""
    size = -(-flat.numel() // dp)
    padded = torch.cat([flat, torch.zeros(size * dp - flat.numel())])
    lo, hi = rank * size, (rank + 1) * size
    part = padded[lo:hi].clone()
    mapping, pos = {}, 0
    for name, n in names.items():
        a, b = max(pos, lo), min(pos + n, hi)
        if a < b:
            mapping[name] = fragment_address(numel=b - a, start=a - lo)
        pos += n
    moments = torch.cat([part, torch.zeros(1)])  # saved with the alignment padding the fp32 partition lacks
    state = {"step": torch.tensor(step), "exp_avg": moments * 10, "exp_avg_sq": moments * 100}
    return {"param_slice_mappings": [mapping], "single_partition_of_fp32_groups": [part],
            "base_optimizer_state": {"state": {0: state}}}


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_zero_partitions_over_dp_ranks_join_into_whole_parameters_and_moments(dp):
    shapes = {"0.a.weight": torch.Size([3, 5]), "1.b.weight": torch.Size([7]), "1.b.bias": torch.Size([2, 2])}
    values = {n: torch.randn(s) for n, s in shapes.items()}
    flat = torch.cat([v.flatten() for v in values.values()])
    parts = [zero_partition(flat, {n: v.numel() for n, v in values.items()}, dp, r, 3.0) for r in range(dp)]
    got = zero_states(parts, shapes)
    for n, v in values.items():
        assert torch.equal(got[n].master, v)
        assert torch.equal(got[n].optim["exp_avg"], v * 10) and torch.equal(got[n].optim["exp_avg_sq"], v * 100)
        assert float(got[n].step) == 3.0
    assert set(zero_states(parts, {"1.b.weight": shapes["1.b.weight"]})) == {"1.b.weight"}  # other layers skipped


def test_torch_optimizer_state_is_keyed_by_parameter_name_in_group_order():
    a, b, c = (torch.nn.Parameter(torch.randn(2)) for _ in range(3))
    opt = torch.optim.AdamW([{"params": [a, b]}, {"params": [c], "lr": 0.1}])
    for p in (a, b, c):
        p.grad = torch.ones(2)
    opt.step()
    got = torch_optimizer_states(opt.state_dict(), ["0.a", "0.b", "1.c"])
    assert torch.equal(got["1.c"].optim["exp_avg"], opt.state[c]["exp_avg"]) and float(got["0.a"].step) == 1.0
    with pytest.raises(ReshardError, match="lists 3 parameters, the manifest 2"):
        torch_optimizer_states(opt.state_dict(), ["0.a", "0.b"])


def test_read_module_joins_tp_shards_of_weights_and_torch_optimizer_state():
    full_w, full_m = torch.randn(4, 6), torch.randn(4, 6)
    files, records = {}, []
    for t in range(2):
        files[f"llm/layer_01-model_{t:02d}-model_states.pt"] = {"q.weight": cut_tp(full_w, [0, 1], t, 2), "n.weight": torch.ones(6)}
        files[f"llm/mp_rank_{t:02d}_model_states.pt"] = {"optimizer": {
            "param_groups": [{"params": [0, 1]}],
            "state": {0: {"step": torch.tensor(2.0), "exp_avg": cut_tp(full_m, [0, 1], t, 2), "exp_avg_sq": cut_tp(full_m, [0, 1], t, 2)},
                      1: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}}}}
        records.append({"stage": 0, "dp": 0, "tp": t, "pp_size": 1, "dp_size": 1, "tp_size": 2, "layers": [1, 2],
                        "optimizer": "torch", "files": [f"llm/mp_rank_{t:02d}_model_states.pt"],
                        "groups": [["1.q.weight", "1.n.weight"]], "split": {"1.q.weight": [0, 1]}})
    got = read_module("llm", sorted(files), records, files.__getitem__, {1})
    assert torch.equal(got["1.q.weight"].weight, full_w) and torch.equal(got["1.q.weight"].optim["exp_avg"], full_m)
    assert torch.equal(got["1.n.weight"].weight, torch.ones(6))
    with pytest.raises(ReshardError, match=r"no weights saved for layers \[2\]"):
        read_module("llm", sorted(files), records, files.__getitem__, {1, 2})


def test_saved_engine_files_fit_only_the_same_stage_dp_tp_layers_and_optimizer():
    rec = {"stage": 0, "dp": 0, "tp": 0, "pp_size": 1, "dp_size": 2, "tp_size": 1, "layers": [0, 4], "optimizer": "torch"}
    saved = [rec, {**rec, "dp": 1}]
    assert files_fit(saved, rec)
    assert not files_fit(saved, {**rec, "optimizer": "zero"})
    assert not files_fit(saved, {**rec, "dp_size": 1})
    assert not files_fit(saved[:1], {**rec, "dp_size": 1, "layers": [0, 2], "pp_size": 2})


def recipe(*extra: str):
    return load_recipe(REPO / "recipes/tiny_cpu.yaml", ["layout=disaggregated", *extra])


def test_a_new_layout_resumes_but_a_new_model_or_batch_is_refused_in_one_line_naming_every_field(tmp_path):
    manifest = {"step": 3, "fingerprint": fingerprint(recipe(), 4), "shards": {}}
    wide = recipe("parallel.llm.dp=2", "parallel.llm.pp=1", "parallel.generator.dp=2")
    _check_usable(wide, 5, tmp_path, manifest)  # allowed: re-sharded
    assert layout_changes(manifest, wide, 5) == [
        "parallel.generator.dp (checkpoint: 1, this run: 2)", "parallel.llm.dp (checkpoint: 1, this run: 2)",
        "parallel.llm.pp (checkpoint: 2, this run: 1)", "world_size (checkpoint: 4, this run: 5)"]
    _check_usable(recipe("layout=monolithic"), 4, tmp_path, manifest)
    with pytest.raises(ConfigError) as e:
        _check_usable(recipe("model.llm.layers=3", "train.global_batch=8", "data.seq_len=64", "parallel.llm.pp=1"), 3,
                      tmp_path, manifest)
    msg = str(e.value)
    assert "\n" not in msg and "only the layout may change" in msg
    assert all(f in msg for f in ("model.llm.layers", "train.global_batch", "data.seq_len")) and "parallel" not in msg
    with pytest.raises(ConfigError, match="does not describe its shards"):  # written before shard records
        _check_usable(wide, 5, tmp_path, {k: v for k, v in manifest.items() if k != "shards"})


def test_record_data_state_resumes_under_another_dp_split_with_the_same_batches(fixtures_dir):
    import dataclasses

    from disttrain_ds.data.config import DataConfig
    from disttrain_ds.data.producers import build_source
    from disttrain_ds.samples import GenShape, ShapeSpec

    cfg = DataConfig(source="mmc4", path=str(fixtures_dir / "mmc4_sample.jsonl"), seq_len=256, image_sizes=[16, 32])
    one = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
    two = dataclasses.replace(one, dp_size=2, micro_batch=2)
    first = build_source(cfg, one, 4, 7)
    straight = [first.global_batch(s) for s in range(4)]
    part = build_source(cfg, one, 4, 7)
    for s in range(2):
        part.global_batch(s)
    resumed = build_source(cfg, two, 4, 7)
    resumed.load_state_dict(part.state_dict())
    for s in (2, 3):
        assert [torch.equal(a.input_ids, b.input_ids) for a, b in zip(resumed.global_batch(s), straight[s])] == [True] * 4
    other = build_source(dataclasses.replace(cfg, seq_len=128), two, 4, 7)
    with pytest.raises(ValueError, match="different data setup"):  # what the samples are made of still counts
        other.load_state_dict(part.state_dict())


def test_load_into_engine_writes_this_tp_ranks_shards_into_parameters_and_torch_optimizer():
    from types import SimpleNamespace

    from disttrain_ds.checkpoint.reshard import ParamState, load_into_engine

    pm = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.LayerNorm(3))
    pm[0].weight = torch.nn.Parameter(torch.zeros(2, 3))  # TP rank 1 of 2: rows 2-3 of a [4, 3] weight
    pm[0].weight.tp_dim, pm[0].weight.tp_pieces = 0, 1
    opt = torch.optim.AdamW(pm.parameters())
    w, m = torch.randn(4, 3), torch.randn(4, 3)
    full = {"0.weight": ParamState(weight=w, optim={"exp_avg": m, "exp_avg_sq": m * m}, step=torch.tensor(3.0))}
    for n, p in pm.named_parameters():
        if n != "0.weight":
            full[n] = ParamState(weight=torch.full(p.shape, 2.0), optim={"exp_avg": torch.ones(p.shape)}, step=torch.tensor(3.0))
    done = load_into_engine(SimpleNamespace(optimizer=opt), pm, full, 1, 2)
    assert torch.equal(pm[0].weight, w[2:]) and torch.equal(pm[1].weight, torch.full((3,), 2.0))
    assert torch.equal(opt.state[pm[0].weight]["exp_avg"], m[2:]) and float(opt.state[pm[0].weight]["step"]) == 3.0
    assert done == ["weights", "optimizer state (exp_avg, exp_avg_sq, step)"]
    del full["1.bias"]
    with pytest.raises(ReshardError, match="no value for parameter 1.bias"):
        load_into_engine(SimpleNamespace(optimizer=opt), pm, full, 1, 2)


def test_a_checkpoint_of_sgd_without_momentum_reshards_with_no_optimizer_state_and_adam_still_needs_it():
    """Plain SGD keeps no per-parameter state, so its checkpoint has none; Adam's must."""
    from types import SimpleNamespace

    from disttrain_ds.checkpoint.reshard import ParamState, load_into_engine

    pm = torch.nn.Sequential(torch.nn.Linear(3, 2))
    full = {n: ParamState(weight=torch.full(p.shape, 0.5), optim={}, step=None) for n, p in pm.named_parameters()}
    sgd = torch.optim.SGD(pm.parameters(), lr=0.1)
    assert load_into_engine(SimpleNamespace(optimizer=sgd), pm, full, 0, 1) == [
        "weights", "optimizer state (none: SGD without momentum keeps none)"]
    assert torch.equal(pm[0].weight, torch.full((2, 3), 0.5)) and not sgd.state
    for opt in (torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9), torch.optim.AdamW(pm.parameters())):
        with pytest.raises(ReshardError, match="no optimizer state for parameter 0.weight"):
            load_into_engine(SimpleNamespace(optimizer=opt), pm, full, 0, 1)

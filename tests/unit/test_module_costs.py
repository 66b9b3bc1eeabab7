"""Per-module costs over the graph: the audio encoder priced by its clips, reordering and balance see it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from disttrain_ds.cost.graph_costs import GraphCosts
from disttrain_ds.families.whisper import AudioEncoderConfig
from disttrain_ds.families.whisper.estimates import cost_terms, forward_flops_per_clip
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.reorder.balance import dp_balance, module_columns
from disttrain_ds.reorder.inter import reorder_batch
from disttrain_ds.runtime.setup import cost_model
from disttrain_ds.samples import GenShape, PackedSample, ShapeSpec, SpecialTokens

SPECIAL = SpecialTokens.after(256, audio=True)


def test_whisper_cost_terms_count_the_flops_its_layers_run():
    from torch.utils.flop_counter import FlopCounterMode

    from disttrain_ds.families.base import BuildContext
    from disttrain_ds.families.whisper.model import layers
    from disttrain_ds.models.packed import pack_clips

    cfg = AudioEncoderConfig(n_mels=16, hidden_size=32, layers=2, heads=2, ffn_hidden=64, max_frames=64)
    own = [d.build() for d in layers(cfg, BuildContext("ear", 0, llm_hidden=48))]
    for frames in (8, 40):
        x = pack_clips([torch.randn(16, frames)])
        with FlopCounterMode(display=False) as count, torch.no_grad():
            for layer in own:
                x = layer(x)
        # The counter has no formula for CPU attention kernels: add QK^T and AV over the clip's rows.
        attention = cfg.layers * 2 * 2 * cfg.hidden_size * (frames // 2) ** 2
        assert count.get_total_flops() + attention == pytest.approx(forward_flops_per_clip(cfg, frames), rel=1e-9)
    t = cost_terms(cfg)
    assert t["aud_per_frame_sq"] > 0  # attention over rows grows with the squared length


def test_every_module_is_priced_by_name_the_audio_encoder_by_its_clips():
    recipe = load_recipe("tiny_omni")
    costs = cost_model(recipe)
    assert costs.names == ("vision", "ear", "llm", "painter")
    assert costs.kinds == {"vision": "encoder", "ear": "audio", "llm": "llm", "painter": "generator"}
    ear = recipe.model.modules["ear"]
    from disttrain_ds.runtime.setup import build_data_and_spec

    source, spec = build_data_and_spec(recipe)
    s = source.global_batch(0)[0]
    stats = s.stats(recipe.model.modules["vision"].patch_size, spec.special)
    assert stats.audio_frames and costs.module_cost("ear", stats) == pytest.approx(
        sum(forward_flops_per_clip(ear, f) for f in stats.audio_frames))
    # The image encoder does not see the clips, nor the audio encoder the images.
    no_audio = dataclasses.replace(stats, audio_frames=())
    assert costs.module_cost("vision", no_audio) == costs.module_cost("vision", stats)
    assert costs.module_cost("ear", no_audio) == 0.0
    assert costs.costs([stats]).shape == (1, 4)


def _sample(i: int, frames: tuple[int, ...]) -> PackedSample:
    """Samples alike in everything (text, images, documents) but their clips."""
    ids = torch.full((64,), 7, dtype=torch.long)
    return PackedSample(ids, ids.clone(), [torch.zeros(3, 16, 16)], [torch.zeros(0, 3, 16, 16)], i, (64,),
                        audio=[torch.zeros(16, f) for f in frames])


def _rank_loads(samples: list[PackedSample], costs: GraphCosts, name: str, dp: int) -> np.ndarray:
    per = costs.costs([s.stats(8, SPECIAL) for s in samples])[:, costs.column(name)]
    return per.reshape(dp, -1).sum(axis=1)


def test_reordering_evens_a_batch_whose_imbalance_is_only_in_audio():
    costs = cost_model(load_recipe("tiny_omni"))
    # Two DP ranks, one microbatch of 4: in arrival order both long clips land on rank 0.
    samples = [_sample(0, (48,)), _sample(1, (40,)), _sample(2, (16,)), _sample(3, (8,))]
    shape = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),), dp_size=2, micro_batch=2, cost_model=costs)
    before = _rank_loads(samples, costs, "ear", 2)
    after = _rank_loads(reorder_batch(samples, shape, SPECIAL), costs, "ear", 2)
    assert after.sum() == pytest.approx(before.sum())
    assert after.max() / after.mean() < 1.1 < 1.5 < before.max() / before.mean()
    # Negative control: a cost model without the audio column sees four identical samples.
    kinds = {n: k for n, k in costs.kinds.items() if k != "audio"}
    blind = _rank_loads(reorder_batch(samples, dataclasses.replace(shape, cost_model=GraphCosts(costs.model, kinds)),
                                      SPECIAL), costs, "ear", 2)
    assert blind.max() > after.max() * 1.05


def test_balance_figures_exist_per_module_name_for_the_audio_encoder():
    costs = cost_model(load_recipe("tiny_omni"))
    assert module_columns(costs) == {"vision": 0, "ear": 1, "painter": 3}
    samples = [_sample(0, (48,)), _sample(1, (40,)), _sample(2, (8,)), _sample(3, (16,))]
    per = costs.costs([s.stats(8, SPECIAL) for s in samples])
    out = dp_balance(per, slot=4, dp={"vision": 1, "ear": 2, "painter": 1}, columns=module_columns(costs))
    assert {k.rsplit("_load_", 1)[0] for k in out} == {"balance/vision", "balance/ear", "balance/painter"}
    assert out["balance/ear_load_max"] == pytest.approx(_rank_loads(samples, costs, "ear", 2).max()
                                                       / _rank_loads(samples, costs, "ear", 2).mean())
    assert out["balance/vision_load_max"] == 1.0  # one replica: nothing to balance


def test_the_balance_callback_reports_the_audio_encoder_of_a_run():
    from disttrain_ds.runtime.callbacks.balance import Balance
    from disttrain_ds.runtime.placement import Placement
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe("tiny_omni", ["parallel.modules.ear.dp=2", "train.micro_batch=2"])
    source, spec = build_data_and_spec(recipe)
    rec: dict = {}
    Balance(Placement(recipe, spec, {"vision": 1, "ear": 2, "llm": 1, "painter": 1})).on_step_end(
        None, source.global_batch(0), rec)
    assert rec["balance/ear_load_max"] >= 1.0 and rec["balance/ear_load_mean"] > 0
    assert "balance/llm_load_max" not in rec


def test_stage_times_take_the_slowest_module_of_each_role():
    costs = cost_model(load_recipe("tiny_omni"))
    per = np.array([[1.0, 5.0, 2.0, 3.0], [4.0, 1.0, 2.0, 0.0]])  # vision, ear, llm, painter
    assert costs.stage_times(per).tolist() == [[5.0, 2.0, 3.0], [4.0, 2.0, 0.0]]


def test_a_split_even_in_total_is_refined_until_each_encoder_is_even():
    from disttrain_ds.reorder.module_balance import refine_split, split_objective

    # vision, ear, llm: two image-heavy and two clip-heavy samples, every total the same.
    costs = np.array([[10.0, 0.0, 5.0], [0.0, 10.0, 5.0], [10.0, 0.0, 5.0], [0.0, 10.0, 5.0]])
    stages = [0, 0, 1]  # both encoders form the first stage
    even_totals = [[0, 2], [1, 3]]  # vision 20 | 0, ear 0 | 20
    refined = refine_split(costs, even_totals, stages)
    assert {frozenset(g) for g in refined} in ({frozenset({0, 1}), frozenset({2, 3})}, {frozenset({0, 3}), frozenset({1, 2})})
    loads = lambda groups: np.stack([costs[g].sum(axis=0) for g in groups], axis=-1)  # noqa: E731
    assert split_objective(loads(refined), np.array(stages))[0] == 20.0  # 10 + 10, down from 20 + 10
    assert split_objective(loads(even_totals), np.array(stages))[0] == 30.0
    assert refine_split(costs, refined, stages) == refined  # nothing left to gain


def test_reordering_evens_each_encoder_where_summed_costs_tie(monkeypatch):
    from disttrain_ds.cost.model import CostModel
    from disttrain_ds.reorder import inter

    # One FLOP per patch and per frame, nothing else: an image of 16 patches costs what a 16-frame clip does.
    unit = CostModel(enc_per_patch=1.0, enc_per_patch_sq=0.0, llm_per_token=0.0, llm_per_doc_token_sq=0.0,
                     gen_per_latent=0.0, gen_per_latent_sq=0.0, aud_per_frame=1.0)
    costs = GraphCosts(unit, {"vision": "encoder", "ear": "audio", "llm": "llm"})

    def sample(i, image: bool) -> PackedSample:
        s = _sample(i, () if image else (16,))
        s.images = [torch.zeros(3, 32, 32)] if image else []
        return s

    samples = [sample(0, True), sample(1, False), sample(2, True), sample(3, False)]
    shape = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),), dp_size=2, micro_batch=2, cost_model=costs)
    out = reorder_batch(samples, shape, SPECIAL)
    for name in ("vision", "ear"):
        assert _rank_loads(out, costs, name, 2).tolist() == [16.0, 16.0], name
    # Negative control: the split by summed cost alone leaves each encoder's work on one replica.
    monkeypatch.setattr(inter, "refine_split", lambda c, groups, stages, **kw: [list(g) for g in groups])
    summed = reorder_batch(samples, shape, SPECIAL)
    assert sorted(_rank_loads(summed, costs, "vision", 2).tolist()) == [0.0, 32.0]

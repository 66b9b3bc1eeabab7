"""Per-step FLOPs follow the samples actually trained and the frozen-module rule."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain_ds.metrics.step_flops import StepFlopsCounter, flops_modes


def _frozen_encoder(spec, projector_frozen: bool):
    projector = dataclasses.replace(spec.config("encoder").projector, frozen=projector_frozen)
    return spec.with_changes("encoder", frozen=True, projector=projector)


def test_frozen_modes_follow_data_flow(tiny_spec):
    assert flops_modes(_frozen_encoder(tiny_spec, True)) == {
        "encoder": "frozen", "encoder/projector": "frozen", "llm": "train", "generator/projector": "train",
        "generator": "train"}
    # A frozen encoder's projector still trains unless frozen itself.
    assert flops_modes(_frozen_encoder(tiny_spec, False))["encoder/projector"] == "train"
    frozen_llm = tiny_spec.with_changes("llm", frozen=True)
    assert flops_modes(frozen_llm)["llm"] == "frozen_passthrough"


def test_more_images_cost_more_encoder_flops_and_frozen_costs_less(tiny_spec, tiny_source_and_spec):
    samples = tiny_source_and_spec[0].global_batch(0)
    count = StepFlopsCounter(tiny_spec)
    one, two = count(samples[:1]), count(samples[:2])
    one, two = one.modules, two.modules
    assert two["encoder"] > one["encoder"] > 0 and two["llm"] > one["llm"] > 0 and two["generator"] >= one["generator"] > 0
    assert StepFlopsCounter(_frozen_encoder(tiny_spec, True))(samples).modules["encoder"] * 3 == count(samples).modules["encoder"]
    body_only = StepFlopsCounter(_frozen_encoder(tiny_spec, False))(samples).modules["encoder"]
    assert count(samples).modules["encoder"] / 3 < body_only < count(samples).modules["encoder"]


def test_each_encoder_is_priced_by_its_own_familys_item_formula(monkeypatch, tiny_spec, tiny_source_and_spec):
    from disttrain_ds import families

    samples = tiny_source_and_spec[0].global_batch(0)
    vit, cfg = families.FAMILIES["vit"], tiny_spec.config("encoder")
    sizes = [vit.item_size(cfg, im) for s in samples for im in s.images]
    before = StepFlopsCounter(tiny_spec)(samples).modules
    projector = before["encoder"] - 3 * sum(vit.item_flops(cfg, n) for n in sizes)
    assert projector > 0  # the projector's rows are counted beside the family's own layers
    # A family whose images cost twice as much in its own layers: MFU follows its formula, not a ViT's.
    twice = dataclasses.replace(vit, item_flops=lambda c, n: 2 * vit.item_flops(c, n))
    monkeypatch.setitem(families.FAMILIES, "vit", twice)
    after = StepFlopsCounter(tiny_spec)(samples).modules
    assert after["encoder"] == pytest.approx(projector + 6 * sum(vit.item_flops(cfg, n) for n in sizes), rel=1e-12)
    assert after["llm"] == before["llm"] and after["generator"] == before["generator"]

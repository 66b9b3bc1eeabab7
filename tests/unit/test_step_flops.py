"""Per-step FLOPs follow the samples actually trained and the frozen-module rule."""

from __future__ import annotations

import dataclasses

from disttrain_ds.metrics.step_flops import StepFlopsCounter, flops_modes


def _frozen_encoder(spec, projector_frozen: bool):
    projector = dataclasses.replace(spec.encoder.projector, frozen=projector_frozen)
    return dataclasses.replace(spec, encoder=dataclasses.replace(spec.encoder, frozen=True, projector=projector))


def test_frozen_modes_follow_data_flow(tiny_spec):
    assert flops_modes(_frozen_encoder(tiny_spec, True)) == {
        "encoder": "frozen", "encoder/projector": "frozen", "llm": "train", "generator/projector": "train",
        "generator": "train"}
    # A frozen encoder's projector still trains unless frozen itself.
    assert flops_modes(_frozen_encoder(tiny_spec, False))["encoder/projector"] == "train"
    frozen_llm = dataclasses.replace(tiny_spec, llm=dataclasses.replace(tiny_spec.llm, frozen=True))
    assert flops_modes(frozen_llm)["llm"] == "frozen_passthrough"


def test_more_images_cost_more_encoder_flops_and_frozen_costs_less(tiny_spec, tiny_source_and_spec):
    samples = tiny_source_and_spec[0].global_batch(0)
    count = StepFlopsCounter(tiny_spec)
    one, two = count(samples[:1]), count(samples[:2])
    assert two.encoder > one.encoder > 0 and two.llm > one.llm > 0 and two.generator >= one.generator > 0
    assert StepFlopsCounter(_frozen_encoder(tiny_spec, True))(samples).encoder * 3 == count(samples).encoder
    body_only = StepFlopsCounter(_frozen_encoder(tiny_spec, False))(samples).encoder
    assert count(samples).encoder / 3 < body_only < count(samples).encoder

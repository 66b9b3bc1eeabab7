"""Per-step FLOPs follow the samples actually trained and the frozen-module rule."""

from __future__ import annotations

import dataclasses

from disttrain_ds.metrics.step_flops import StepFlopsCounter, flops_modes


def test_frozen_modes_follow_data_flow(tiny_spec):
    frozen_enc = dataclasses.replace(tiny_spec, encoder=dataclasses.replace(tiny_spec.encoder, frozen=True))
    assert flops_modes(frozen_enc) == {"encoder": "frozen", "llm": "train", "generator": "train"}
    frozen_llm = dataclasses.replace(tiny_spec, llm=dataclasses.replace(tiny_spec.llm, frozen=True))
    assert flops_modes(frozen_llm)["llm"] == "frozen_passthrough"


def test_more_images_cost_more_encoder_flops_and_frozen_costs_less(tiny_spec, tiny_source_and_spec):
    samples = tiny_source_and_spec[0].global_batch(0)
    count = StepFlopsCounter(tiny_spec)
    one, two = count(samples[:1]), count(samples[:2])
    assert two.encoder > one.encoder > 0 and two.llm > one.llm > 0 and two.generator >= one.generator > 0
    frozen = dataclasses.replace(tiny_spec, encoder=dataclasses.replace(tiny_spec.encoder, frozen=True))
    assert StepFlopsCounter(frozen)(samples).encoder * 3 == count(samples).encoder

"""Several encoders in the runtime: rank map, stage offsets, links, schedule and the LLM's scatter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from disttrain_ds.comm.boundary import boundary_links
from disttrain_ds.comm.p2p import ACT, GRAD, channel
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.schedule.onef1b import BoundaryRecvActivation, StagePlace, engine_schedule
from disttrain_ds.topology import Topology


def _topo(*overrides: str) -> Topology:
    return topology_of(load_recipe("tiny_omni", ["layout=disaggregated", *overrides]))


def test_a_shorter_encoder_starts_later_on_the_longest_path():
    topo = _topo("parallel.modules.ear.pp=2")  # vision 0, ear 1-2, llm 3-4, painter 5
    assert [(m.name, list(m.ranks)) for m in topo.modules] == [
        ("vision", [0]), ("ear", [1, 2]), ("llm", [3, 4]), ("painter", [5])]
    assert {m.name: topo.stage_offset(m.name) for m in topo.modules} == {"vision": 1, "ear": 0, "llm": 2, "painter": 4}
    assert topo.total_stages == 5 and topo.edges == (("vision", "llm"), ("ear", "llm"), ("llm", "painter"))
    assert [m.name for m in topo.upstreams("llm")] == ["vision", "ear"]


def test_links_join_every_encoder_to_the_llm_and_never_the_encoders_to_each_other():
    topo = _topo("parallel.modules.vision.dp=2", "parallel.modules.ear.dp=2", "train.micro_batch=2")
    # vision 0-1, ear 2-3, llm 4-5 (PP=2), painter 6
    backward = {"vision": True, "ear": False, "llm": True, "painter": True}
    links = boundary_links(topo.modules, 2, backward, topo.edges)
    assert links == sorted(links, key=lambda link: (link[1], link[2], link[0]))
    vision, ear, painter = (("vision", "llm"), ("ear", "llm"), ("llm", "painter"))
    assert set(links) == {(channel(ACT, *vision), 0, 4), (channel(GRAD, *vision), 0, 4), (channel(ACT, *vision), 1, 4),
                          (channel(GRAD, *vision), 1, 4), (channel(ACT, *ear), 2, 4), (channel(ACT, *ear), 3, 4),
                          (channel(ACT, *painter), 5, 6), (channel(GRAD, *painter), 5, 6)}  # a frozen ear: no gradients


def test_a_first_stage_without_upstream_past_global_stage_zero_receives_nothing():
    place = StagePlace(total_stages=4, global_stage=1, first_of_engine=True, last_of_engine=True, has_upstream=False,
                       has_downstream=True, backward=True, upstream_backward=False)
    cmds = [type(c) for step in engine_schedule(3, place) for c in step]
    assert ds.ForwardPass in cmds and ds.BackwardPass in cmds
    assert not {ds.RecvActivation, BoundaryRecvActivation, ds.SendGrad} & set(cmds)
    with_upstream = dataclasses.replace(place, has_upstream=True)
    assert BoundaryRecvActivation in [type(c) for step in engine_schedule(3, with_upstream) for c in step]


def test_the_llm_fills_each_encoders_placeholders_with_that_encoders_rows():
    from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate, llm_inputs
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe("tiny_omni")
    source, spec = build_data_and_spec(recipe)
    assert spec.encoders == ("vision", "ear") and spec.placeholders() == (spec.special.image, spec.special.audio)
    samples = source.global_batch(0)[:2]
    mb = collate(samples, BatchNorms.of(samples, 1), spec)
    model = ReferenceMLLM(spec)
    embed = model.llm.layers[0]
    image = model.vision(mb.encoder_inputs("image"))
    audio = model.ear(mb.encoder_inputs("audio"))
    assert image.shape[0] == sum(mb.sample_rows["image_embeds"]) and audio.shape[0] == sum(mb.sample_rows["audio_embeds"])
    hidden, _ = embed(llm_inputs(mb, [image, audio]))
    ids = mb.input_ids
    torch.testing.assert_close(hidden[ids == spec.special.audio], audio)
    torch.testing.assert_close(hidden[ids == spec.special.image], image)
    wrong, _ = embed(llm_inputs(mb, [image, audio.flip(0)]))
    assert not torch.allclose(wrong, hidden)  # the rows' order is what the placement checks
    loss = model(mb)["loss"]
    loss.backward()
    trained = [p for p in model.ear.parameters() if p.requires_grad]  # Whisper's positions are fixed
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
    source.close()


def test_a_frozen_encoder_runs_no_backward_whatever_the_other_encoder_does():
    from disttrain_ds.graph import ModuleGraph

    g = ModuleGraph.from_roles({"vision": "encoder", "ear": "encoder", "llm": "llm", "painter": "generator"})
    assert g.runs_backward({"vision": True, "ear": False, "llm": False, "painter": False}) == {
        "vision": True, "ear": False, "llm": True, "painter": True}
    assert g.runs_backward({"vision": False, "ear": False, "llm": False, "painter": True})["llm"] is False


def test_audio_encoder_flops_and_memory_come_from_its_family():
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.metrics.step_flops import StepFlopsCounter
    from disttrain_ds.runtime.setup import build_data_and_spec

    def ear_flops(*overrides):
        source, spec = build_data_and_spec(load_recipe("tiny_omni", list(overrides)))
        samples = source.global_batch(0)
        source.close()
        count = StepFlopsCounter(spec)
        return count.module("ear", samples), count.module("ear", samples * 2)

    train, twice = ear_flops()
    frozen, _ = ear_flops("model.modules.ear.frozen=true", "model.modules.ear.projector.frozen=true")
    assert train > 0 and twice == pytest.approx(2 * train) and frozen == pytest.approx(train / 3)
    rows = {r.module: r for r in estimate(load_recipe("tiny_omni", ["layout=disaggregated"]))}
    assert rows["ear"].activations > 0 and rows["ear"].params > 0


def test_emulating_the_audio_encoder_waits_the_cost_of_its_clips():
    from disttrain_ds.families.whisper.estimates import forward_flops_per_clip
    from disttrain_ds.runtime import emulate
    from disttrain_ds.runtime.emulate import Emulator
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe("tiny_omni", ["layout=disaggregated", "emulate.enabled=true", "emulate.tflops=1"])
    topo = topology_of(recipe)
    flops = emulate.calibration_flops(recipe)
    assert set(flops) == set(emulate.recipe_rates(recipe, topo)) == {"vision", "ear", "llm", "painter"}
    assert (flops["ear"] > 0).all()
    source, spec = build_data_and_spec(recipe)
    samples = source.global_batch(0)
    ear = Emulator.for_rank(recipe, topo, 1, spec, backward=True)  # vision 0, ear 1, llm 2-3, painter 4
    assert (ear.module, ear.role) == ("ear", "encoder")
    ear.set_step(0, [[s] for s in samples])
    cfg = recipe.model.modules["ear"]
    want = [ear.ms_per_flop * sum(forward_flops_per_clip(cfg, c.shape[1]) for c in s.audio) for s in samples]
    assert ear.fwd_ms == pytest.approx(want) and min(want) > 0

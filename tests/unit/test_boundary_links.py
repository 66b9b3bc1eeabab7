"""Which rank pairs talk across module boundaries, on which channel, in which global order."""

from __future__ import annotations

from disttrain_ds.comm.boundary import boundary_links
from disttrain_ds.comm.p2p import ACT, GRAD, channel
from disttrain_ds.topology import ModuleGrid

TRAIN_ALL = {"encoder": True, "llm": True, "generator": True}
# Each graph edge has its own channel per direction.
A_IN, G_IN = channel(ACT, "encoder", "llm"), channel(GRAD, "encoder", "llm")
A_OUT, G_OUT = channel(ACT, "llm", "generator"), channel(GRAD, "llm", "generator")


def _readme_layout(enc_dp=1, llm_tp=1):
    enc = ModuleGrid("encoder", 0, dp=enc_dp, pp=1)
    llm = ModuleGrid("llm", enc.size, dp=1, pp=2, tp=llm_tp)
    gen = ModuleGrid("generator", enc.size + llm.size, dp=1, pp=1)
    return enc, llm, gen


def test_readme_layout_links_encoder_to_llm_first_stage_and_llm_last_stage_to_generator():
    links = boundary_links(_readme_layout(), slot=2, backward=TRAIN_ALL)
    assert links == [(A_IN, 0, 1), (G_IN, 0, 1), (A_OUT, 2, 3), (G_OUT, 2, 3)]


def test_dp_fan_in_links_every_upstream_replica_to_the_replica_owning_its_samples():
    links = boundary_links(_readme_layout(enc_dp=2), slot=2, backward=TRAIN_ALL)
    assert [(lo, hi) for ch, lo, hi in links if ch in (A_IN, A_OUT)] == [(0, 2), (1, 2), (3, 4)]


def test_a_frozen_front_module_gets_no_gradient_channel():
    frozen_encoder = {**TRAIN_ALL, "encoder": False}
    links = boundary_links(_readme_layout(), slot=2, backward=frozen_encoder)
    assert (G_IN, 0, 1) not in links and (A_IN, 0, 1) in links and (G_OUT, 2, 3) in links


def test_only_tensor_parallel_index_zero_talks_across_boundaries():
    enc, llm, gen = _readme_layout(llm_tp=2)  # LLM ranks 1-4: stage 0 = 1, 2; stage 1 = 3, 4
    links = boundary_links((enc, llm, gen), slot=2, backward=TRAIN_ALL)
    assert {r for _, lo, hi in links for r in (lo, hi)} == {0, 1, 3, 5}


def test_links_come_in_one_global_order_with_no_repeats():
    enc = ModuleGrid("encoder", 0, dp=2, pp=1)
    llm = ModuleGrid("llm", 2, dp=3, pp=1)
    gen = ModuleGrid("generator", 5, dp=2, pp=1)
    links = boundary_links((enc, llm, gen), slot=6, backward=TRAIN_ALL)
    keys = [(lo, hi, ch) for ch, lo, hi in links]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert all(lo < hi for _, lo, hi in links)

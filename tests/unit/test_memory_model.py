"""The per-rank memory formula the planner and the runtime's dry run share (no processes)."""

from __future__ import annotations

import random

import pytest

from disttrain_ds.cost import memory_model as mm
from disttrain_ds.cost.activations import LayerBytes
from disttrain_ds.estimate.memory import _stage_activations
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.objective import Degrees, module_in_flight


@pytest.mark.parametrize("seed", range(20))
def test_stages_to_end_is_what_the_chain_of_stage_offsets_gives(seed):
    r = random.Random(seed)
    encs = [f"e{i}" for i in range(r.randint(0, 3))]
    gens = [f"g{i}" for i in range(r.randint(0 if encs else 1, 3))]
    graph = ModuleGraph.from_roles({**{e: "encoder" for e in encs}, "llm": "llm", **{g: "generator" for g in gens}})
    pp = {n: r.randint(1, 6) for n in graph.names}
    offsets, total = graph.stage_offsets(pp)
    gen = max((pp[g] for g in gens), default=0)
    for n in graph.names:
        got = mm.stages_to_end(graph.role(n), pp[n], pp["llm"], gen)
        assert got == total - offsets[n]
        k = r.randint(1, 12)
        layout = {m: Degrees(1, 1, pp[m]) for m in graph.names}
        assert module_in_flight(graph, n, layout, k) == min(total - offsets[n], k)


def test_in_flight_counts_every_stage_downstream_not_only_the_modules_own():
    # An encoder of 2 stages before an LLM of 10 and a generator of 1 holds 13 microbatches at its
    # first stage, not 2 (the coarser count that let a 72B plan through that the runtime refused).
    assert mm.in_flight(mm.stages_to_end("encoder", 2, 10, 1), 320) == 13
    assert mm.in_flight(mm.stages_to_end("encoder", 2, 10, 1), 4) == 4


def test_tp_splits_only_the_sharded_part_of_what_a_layer_saves():
    lb = LayerBytes(saved=[10.0, 100.0], outputs=[5.0, 5.0], inputs=1.0, sharded=[0.0, 80.0])
    assert lb.on_rank(4) == [10.0, 20.0 + 20.0]
    kept, work = _stage_activations(lb, 0, 2, tp=4)
    assert kept == 10.0 + 40.0 + 1.0 + 5.0  # inputs and outputs whole on every TP rank
    assert work == 40.0
    # A family that does not say keeps everything whole (never under-counted).
    assert LayerBytes([10.0, 100.0], [5.0, 5.0], 1.0).on_rank(4) == [10.0, 100.0]


def test_rank_bytes_shards_states_over_tp_and_optimizer_over_its_dp_group():
    w, g, o = mm.state_bytes(8e9, 2, 2, 2, 12, 4)
    assert (w, g, o) == (8e9, 8e9, 12e9)
    assert mm.rank_bytes(8e9, 2, (2, 2, 12), 4, kept=1e9, workspace=2e9, samples=3, flight=5) \
        == 8e9 + 8e9 + 12e9 + 5 * 3 * 1e9 + 3 * 2e9

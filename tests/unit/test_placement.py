"""Who holds which units of a microbatch slot: encoders' items and generators' target images split
over replicas, the replicas' microbatches keep each target's noise, and the boundary owners agree
with the rows each side packs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from disttrain_ds.mllm.model import BatchNorms, collate
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.placement import Placement, carriers
from disttrain_ds.runtime.setup import build_data_and_spec

SLOT = 4
LAYOUT = ["layout=disaggregated", "parallel.modules.llm.dp=2", "parallel.modules.llm.pp=1", "parallel.modules.painter.dp=2",
          "parallel.modules.sketcher.dp=2", "train.micro_batch=2", "train.global_batch=8", "parallel.post_balance=true"]


@pytest.fixture(scope="module")
def job():
    recipe = load_recipe("tiny_two_gen", LAYOUT)
    source, spec = build_data_and_spec(recipe)
    batches = [source.global_batch(step) for step in range(12)]
    source.close()
    dps = {n: 2 for n in spec.names}
    return recipe, spec, batches, Placement(recipe, spec, dps)


def _split_sample(spec, batches, placement):
    """A (batch, slot, plan, generator) whose targets of one sample sit on both replicas."""
    for b in batches:
        for g, plan in enumerate(placement.plans(b)):
            for n in spec.generators:
                owners = [{r for r, part in enumerate(plan.units[n]) for p, _ in part if p == q} for q in range(SLOT)]
                if any(len(o) == 2 for o in owners):
                    return b, g, plan, n
    pytest.fail("no sample's targets were split over both generator replicas")


def test_every_generator_target_is_held_once_and_each_replica_gets_its_share(job):
    _, spec, batches, placement = job
    for b in batches:
        for g, plan in enumerate(placement.plans(b)):
            for n in spec.generators:
                k = spec.gen_index(n)
                want = sorted((p, j) for p in range(SLOT) for j in range(int(b[g * SLOT + p].gen_targets[k].shape[0])))
                assert sorted(u for part in plan.units[n] for u in part) == want
                assert all(part == sorted(part) for part in plan.units[n])


def test_a_replicas_targets_keep_their_noise_when_a_sample_is_split(job):
    recipe, spec, batches, placement = job
    b, g, plan, name = _split_sample(spec, batches, placement)
    norms = BatchNorms.of(b, 1, len(spec.generators))
    whole = collate(b[g * SLOT:(g + 1) * SLOT], norms, spec).gens[name]
    units = sorted(u for part in plan.units[name] for u in part)
    got = {}
    for part in plan.units[name]:
        mine = collate(carriers(b, g * SLOT, part, SLOT, spec, name), norms, spec)
        assert mine.sample_rows[spec.gen_rows_key(name)] == [1] * len(part)
        for u, e, t in zip(part, mine.gens[name].noise, mine.gens[name].timesteps):
            got[u] = (e, t)
    for i, u in enumerate(units):
        assert torch.equal(got[u][0], whole.noise[i]) and int(got[u][1]) == int(whole.timesteps[i])
    # Negative control: a replica's copy that forgets where its targets sit draws other noise.
    late = next(part for part in plan.units[name] if any(j > 0 for _, j in part))
    forgot = [replace(s, target_index=()) for s in carriers(b, g * SLOT, late, SLOT, spec, name)]
    noise = collate(forgot, norms, spec).gens[name].noise
    assert not all(torch.equal(noise[i], got[u][0]) for i, u in enumerate(late))


def test_boundary_owners_list_each_side_s_rows_in_slot_order(job):
    _, spec, batches, placement = job
    b = batches[0]
    plan = placement.plans(b)[0]
    norms = BatchNorms.of(b, 1, len(spec.generators))
    llm = collate(b[:2], norms, spec)  # LLM replica 0 holds the first block of two samples
    for n in spec.generators:
        up, down = plan.edge_owners(spec.name_of("llm"), n)
        assert len(up) == len(down) == sum(len(part) for part in plan.units[n])
        assert up.count(0) == len(llm.sample_rows[spec.gen_rows_key(n)])
        for r, part in enumerate(plan.units[n]):
            assert down.count(r) == len(part)
    for n in spec.encoders:
        up, down = plan.edge_owners(n, spec.name_of("llm"))
        assert down.count(0) == len(llm.sample_rows[f"{spec.modality(n)}_embeds"])


def test_replica_loads_add_up_to_the_modules_per_sample_costs(job):
    _, spec, batches, placement = job
    b = batches[1]
    loads = placement.loads(b)
    stats = [s.stats(1, spec.special) for s in b]
    for n in spec.generators:
        total = sum(float(sum(slot)) for slot in loads[n])
        assert total == pytest.approx(sum(placement.costs.module_cost(n, s) for s in stats), rel=1e-9)


def test_with_per_host_reading_replicas_split_only_their_hosts_blocks(job):
    recipe, spec, batches, _ = job
    dps = {"vision": 4, "llm": 2, "painter": 2, "sketcher": 2}
    # Vision replicas 0, 1 on host a, 2, 3 on host b; each generator replica on a host of its own.
    homes = {"vision": [frozenset("a")] * 2 + [frozenset("b")] * 2, "llm": [frozenset("a"), frozenset("b")],
             "painter": [frozenset("a"), frozenset("b")], "sketcher": [frozenset("a"), frozenset("b")]}
    hosted = Placement(recipe, spec, dps, homes)
    free = Placement(recipe, spec, dps)
    crossed = False
    for b in batches:
        for plan, loose in zip(hosted.plans(b), free.plans(b)):
            for r, part in enumerate(plan.units["vision"]):  # blocks of one sample: a's are 0, 1
                assert {p for p, _ in part} <= ({0, 1} if r < 2 else {2, 3})
            for n in spec.generators:  # alone on its host: its own block, as without post-balancing
                assert all({p for p, _ in part} <= {2 * r, 2 * r + 1} for r, part in enumerate(plan.units[n]))
            # Negative control: without hosts a replica takes units of samples the other host read.
            crossed |= any(not {p for p, _ in part} <= ({0, 1} if r < 2 else {2, 3})
                           for r, part in enumerate(loose.units["vision"]))
    assert crossed


ADAPTIVE_ENCODER = ["layout=disaggregated", "parallel.llm.pp=1", "parallel.encoder.dp=4", "parallel.encoder.sp=auto",
                    "parallel.sp_bandwidth_gbs=[8,8]", "train.peak_tflops=1", "data.image_sizes=[8,32,64]",
                    "data.max_images=2", "train.micro_batch=4", "train.global_batch=8", "model.encoder.heads=4"]


def test_adaptive_encoder_groups_hold_each_item_once_under_their_lead_and_cover_every_rank():
    """``parallel.encoder.sp: auto``: per slot, aligned power-of-two groups over the 4 encoder ranks
    (ranks left idle alone), each image in one group, listed under its first rank; the boundary
    routes each image to that rank. Over the steps both splits and single ranks occur."""
    recipe = load_recipe("tiny_cpu", ADAPTIVE_ENCODER)
    source, spec = build_data_and_spec(recipe)
    batches = [source.global_batch(step) for step in range(6)]
    source.close()
    placement = Placement(recipe, spec, {"encoder": 4, "llm": 1, "generator": 1}, adaptive=["encoder"], per_node=8)
    sizes = set()
    for b in batches:
        for g, plan in enumerate(placement.plans(b)):
            slot = b[g * 4:(g + 1) * 4]
            groups = plan.groups["encoder"]
            assert [first for first, _, _ in groups] == [sum(s for _, s, _ in groups[:i]) for i in range(len(groups))]
            assert sum(s for _, s, _ in groups) == 4 and all(f % s == 0 and s & (s - 1) == 0 for f, s, _ in groups)
            items = sorted(u for _, _, held in groups for u in held)
            assert items == [(p, j) for p, s in enumerate(slot) for j in range(len(s.images))]
            for first, size, held in groups:
                assert plan.units["encoder"][first] == list(held)
                assert all(plan.units["encoder"][r] == [] for r in range(first + 1, first + size))
            up, down = plan.edge_owners("encoder", "llm")
            leads = {u: first for first, _, held in groups for u in held}
            assert up == [leads[u] for u in items] and down == [0] * len(items)
            sizes |= {s for _, s, _ in groups}
    assert {1, 2} <= sizes or {1, 4} <= sizes, sizes

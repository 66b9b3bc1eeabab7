"""Adaptive SP groups (FlexSP): aligned power-of-two groups per microbatch, never slower than a
static degree under the cost model, near the optimum on small cases (pure)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from disttrain_ds.reorder.sp_groups import SPCost, adaptive_groups, static_groups


def cost(tokens_per_gpu: float = 1e9, pair: float = 1e-3, a2a: float = 2.0) -> SPCost:
    """1 ms per token of linear work, attention ``pair`` ms per pair; all-to-alls at 1 GB/s within 2,
    0.5 GB/s beyond."""
    return SPCost(ms_per_flop=1.0, linear_flops=1.0, pair_flops=pair, a2a_bytes_per_token=a2a * 1e6,
                  bandwidth_gbs={2: 1.0, 4: 0.5}, tokens_per_gpu=tokens_per_gpu)


def check_plan(plan, lengths, n, c: SPCost) -> None:
    seen = sorted(i for g in plan.groups for i in g.seqs)
    assert seen == list(range(len(lengths)))  # every sequence exactly once
    ranks = [r for g in plan.groups for r in range(g.first, g.first + g.size)]
    assert len(ranks) == len(set(ranks)) and all(0 <= r < n for r in ranks)
    for g in plan.groups:
        assert g.size & (g.size - 1) == 0 and g.first % g.size == 0  # aligned power of two
        assert sum(lengths[i] for i in g.seqs) <= g.size * c.tokens_per_gpu
        assert g.ms == pytest.approx(sum(c.seq_ms(lengths[i], g.size) for i in g.seqs))


def optimum(lengths, n, c: SPCost) -> float:
    """Brute force over every aligned split of n ranks into power-of-two groups and every assignment."""

    def splits(first: int, size: int):
        yield [(first, size)]
        if size > 1:
            for a in splits(first, size // 2):
                for b in splits(first + size // 2, size // 2):
                    yield a + b

    best = float("inf")
    for groups in splits(0, n):
        for assign in itertools.product(range(len(groups)), repeat=len(lengths)):
            load, tokens = [0.0] * len(groups), [0] * len(groups)
            for i, g in enumerate(assign):
                load[g] += c.seq_ms(lengths[i], groups[g][1])
                tokens[g] += lengths[i]
            if all(t <= groups[g][1] * c.tokens_per_gpu for g, t in enumerate(tokens)):
                best = min(best, max(load))
    return best


def test_one_long_and_many_short_sequences_take_one_sp2_group_and_two_sp1_groups():
    c = cost()
    lengths = [4000] + [1000] * 7
    plan = adaptive_groups(lengths, 4, c)
    check_plan(plan, lengths, 4, c)
    assert plan.sizes == (2, 1, 1) and plan.groups[0].seqs == (0,)
    statics = [static_groups(lengths, 4, p, c).makespan for p in (1, 2, 4)]
    assert plan.makespan < min(statics)
    assert plan.makespan == pytest.approx(optimum(lengths, 4, c))


def test_adaptive_is_never_slower_than_any_static_degree_and_near_the_optimum():
    rng = random.Random(3)
    ratios = []
    for _ in range(30):
        n = rng.choice([2, 4])
        lengths = [int(rng.paretovariate(1.2) * 300) for _ in range(rng.randint(2, 5))]
        c = cost(tokens_per_gpu=rng.choice([1e9, 2000.0]))
        plan = adaptive_groups(lengths, n, c)
        best = optimum(lengths, n, c)
        if plan is None:
            assert best == float("inf")
            continue
        check_plan(plan, lengths, n, c)
        for p in (s for s in (1, 2, 4) if s <= n):
            static = static_groups(lengths, n, p, c)
            assert static is None or plan.makespan <= static.makespan * (1 + 1e-12)
        ratios.append(plan.makespan / best)
    assert max(ratios) < 1.15 and sum(ratios) / len(ratios) < 1.03, ratios


def test_memory_forces_long_sequences_onto_large_enough_groups():
    c = cost(tokens_per_gpu=1000)
    lengths = [3500, 800, 600, 900]
    assert static_groups(lengths, 8, 1, c) is None and static_groups(lengths, 8, 2, c) is None  # 3500 > 2 x 1000
    plan = adaptive_groups(lengths, 8, c)
    check_plan(plan, lengths, 8, c)
    assert next(g for g in plan.groups if 0 in g.seqs).size >= 4
    assert adaptive_groups([9000], 8, c) is None  # more than all 8 GPUs hold


def test_groups_are_the_same_for_the_same_lengths_and_bad_input_is_refused():
    c = cost()
    lengths = [5000, 300, 2000, 2000, 100, 7000]
    assert adaptive_groups(lengths, 8, c) == adaptive_groups(list(lengths), 8, c)
    with pytest.raises(ValueError, match="power of two"):
        adaptive_groups(lengths, 6, c)
    with pytest.raises(ValueError, match="positive integers"):
        adaptive_groups([10, 0], 4, c)
    with pytest.raises(ValueError, match="does not divide"):
        static_groups(lengths, 8, 3, c)


def test_runtime_groups_cover_every_rank_and_none_is_empty():
    from disttrain_ds.reorder.sp_groups import covering_groups

    c = cost()
    rng = random.Random(5)
    for _ in range(40):
        n = rng.choice([2, 4, 8])
        lengths = [int(rng.paretovariate(1.1) * 200) for _ in range(rng.randint(n, 3 * n))]
        plan = covering_groups(lengths, n, c)
        check_plan(plan, lengths, n, c)
        assert sum(plan.sizes) == n and all(g.seqs for g in plan.groups)
    few = covering_groups([500, 100], 8, c)  # two sequences on 8 ranks: at most two groups, none empty
    check_plan(few, [500, 100], 8, c)
    assert len(few.groups) <= 2 and sum(few.sizes) == 8 and all(g.seqs for g in few.groups)


@pytest.mark.parametrize("family", ["vit", "whisper", "siglip"])
def test_an_encoder_item_is_priced_by_its_family_flops_with_every_row_attending_to_every_other(family):
    """``item_cost`` in rows: the family's training FLOPs of an item (less its per-item constant,
    as for an LLM's sequence), with full (not causal) attention pairs."""
    from disttrain_ds.cost.flops import training_flops
    from disttrain_ds.families import FAMILIES
    from disttrain_ds.reorder.sp_groups import item_cost

    fam = FAMILIES[family]
    cfg = fam.config_type()
    c = item_cost(fam, cfg, tflops=1.0, bandwidth_gbs={2: 1.0}, tokens_per_gpu=1e9)
    flops = {x: training_flops(fam.item_flops(cfg, x)) for x in (64, 256, 1024)}
    priced = {x: c.seq_ms(fam.rows(cfg, x), 1) * 1e9 for x in flops}  # ms at 1 TFLOP/s -> FLOPs
    constant = {x: flops[x] - priced[x] for x in flops}
    assert max(constant.values()) - min(constant.values()) < 1e-9 * flops[1024]  # the same constant
    assert -1e-9 * flops[64] < constant[64] < 0.05 * flops[64]
    causal = replace(c, causal=True)  # negative control: a causal mask keeps about half of the pairs
    rows = fam.rows(cfg, 1024)
    assert causal.seq_ms(rows, 1) < 0.99 * c.seq_ms(rows, 1)


def test_an_encoder_item_on_a_group_pays_its_compute_over_the_group_and_its_rows_all_to_alls():
    from disttrain_ds.families import FAMILIES
    from disttrain_ds.reorder.sp_groups import item_cost

    fam = FAMILIES["vit"]
    c = item_cost(fam, fam.config_type(), tflops=1.0, bandwidth_gbs={2: 10.0, 4: 10.0}, tokens_per_gpu=1e9)
    assert c.seq_ms(256, 4) == pytest.approx(c.seq_ms(256, 1) / 4 + c.a2a_ms(256, 4))
    assert c.a2a_ms(256, 4) > 0 and c.a2a_ms(256, 1) == 0

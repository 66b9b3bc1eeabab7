"""Reordering constrained to each host's positions (``reorder/host.py``, ``batch_order``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from disttrain_ds.cost.graph_costs import as_graph_costs
from disttrain_ds.data.host_read import rank_positions, reader_classes
from disttrain_ds.data.paper_stats import draw_sample_stats
from disttrain_ds.reorder.host import check_classes, class_lpt, host_microbatches
from disttrain_ds.reorder.inter import _span, batch_order
from disttrain_ds.reorder.module_balance import refine_split

MODEL = as_graph_costs(None)
GROUPS, PER_GROUP = 4, 2
SLOT = GROUPS * PER_GROUP
LAYOUTS = {
    "2 hosts, 2 groups each": [0] * 4 + [1] * 4,
    "4 hosts, 1 group each": [0, 0, 1, 1, 2, 2, 3, 3],
    "2 hosts, alternate samples": [0, 1] * 4,
}


@pytest.fixture(scope="module")
def paper_batch() -> np.ndarray:
    return MODEL.costs(draw_sample_stats(64, 8192, np.random.default_rng(0)))


def _split(order, groups=GROUPS, per_group=PER_GROUP):
    slot = groups * per_group
    return [[list(order[j * slot + r * per_group:j * slot + (r + 1) * per_group]) for r in range(groups)]
            for j in range(len(order) // slot)]


def _dp_imbalance(total, order) -> float:
    """Sum over microbatches of the slowest DP group's summed cost."""
    return sum(max(total[g].sum() for g in mb) for mb in _split(order))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_host_order_never_moves_a_sample_to_another_hosts_position(paper_batch, layout):
    labels = LAYOUTS[layout] * 8
    order = batch_order(paper_batch, MODEL, GROUPS, PER_GROUP, labels, math.inf)
    assert sorted(order) == list(range(64))
    assert [labels[i] for i in order] == labels


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_host_computes_the_same_order_from_the_same_costs(paper_batch, layout):
    labels = LAYOUTS[layout] * 8
    orders = [batch_order(paper_batch.copy(), MODEL, GROUPS, PER_GROUP, list(labels), math.inf) for _ in range(3)]
    assert orders[0] == orders[1] == orders[2]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_host_order_balances_better_than_no_reordering_on_paper_costs(paper_batch, layout):
    labels = LAYOUTS[layout] * 8
    order = batch_order(paper_batch, MODEL, GROUPS, PER_GROUP, labels, math.inf)
    none = list(range(64))
    assert _span(paper_batch, MODEL, _split(order)) < _span(paper_batch, MODEL, _split(none))
    total = paper_batch.sum(axis=1)
    assert _dp_imbalance(total, order) < _dp_imbalance(total, none)


def test_host_order_is_never_slower_than_no_reordering():
    rng = np.random.default_rng(3)
    for _ in range(20):
        costs = rng.gamma(0.5, 1.0, (16, 3)) + 1e-3
        order = batch_order(costs, MODEL, 2, 2, [0, 1, 0, 1] * 4, math.inf)
        assert _span(costs, MODEL, _split(order, 2, 2)) <= _span(costs, MODEL, _split(list(range(16)), 2, 2)) + 1e-9


def test_unconstrained_order_moves_samples_across_hosts(paper_batch):
    """Negative control: the check above fails for the whole-batch reordering."""
    labels = LAYOUTS["2 hosts, 2 groups each"] * 8
    order = batch_order(paper_batch, MODEL, GROUPS, PER_GROUP, None, math.inf)
    assert [labels[i] for i in order] != labels


def test_class_lpt_keeps_each_groups_class_counts_and_never_beats_identity_downwards():
    rng = np.random.default_rng(1)
    labels = [0, 0, 1, 1, 0, 1]
    for _ in range(50):
        c = rng.exponential(1.0, 6)
        groups = class_lpt(c, labels, 2)
        assert sorted(i for g in groups for i in g) == list(range(6))
        assert [sorted(labels[i] for i in g) for g in groups] == [[0, 0, 1], [0, 1, 1]]
        assert max(c[g].sum() for g in groups) <= max(c[:3].sum(), c[3:].sum()) + 1e-12


def test_class_lpt_balances_within_a_class_only():
    # Host 0 holds the heavy samples; alone it cannot even out its two groups with host 1's.
    groups = class_lpt([9.0, 1.0, 8.0, 2.0], [0, 1, 0, 1], 2)
    assert groups == [[0, 3], [1, 2]] or groups == [[0, 1], [2, 3]]
    assert all(sorted([0, 1, 0, 1][i] for i in g) == [0, 1] for g in groups)


def test_sorted_membership_deals_each_class_heaviest_first():
    total = [5, 1, 7, 2, 3, 8, 4, 6]
    mbs = host_microbatches(total, [0, 1] * 4, 2, sort=True)
    assert mbs == [[2, 5], [0, 7], [6, 3], [4, 1]]
    assert host_microbatches(total, [0, 1] * 4, 2, sort=False) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_labels_that_differ_between_slots_are_refused():
    with pytest.raises(ValueError, match="differ between microbatch slots"):
        check_classes([0, 1, 1, 0], 2)


def test_module_refinement_swaps_only_within_a_class():
    rng = np.random.default_rng(2)
    costs = rng.exponential(1.0, (8, 3))
    classes = [0, 1, 0, 1, 0, 1, 0, 1]
    start = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for _ in range(5):
        out = refine_split(costs, start, [0, 1, 2], classes=classes)
        assert [sorted(classes[i] for i in g) for g in out] == [[0, 0, 1, 1]] * 2
        costs = rng.exponential(1.0, (8, 3))


def test_reader_classes_follow_the_hosts_of_each_dp_block():
    class Grid:  # a module of 2 DP replicas on ranks 0 and 1
        def __init__(self, ranks):
            self.dp, self.ranks = 2, ranks

        def coords(self, r):
            return 0, self.ranks.index(r), 0

    consumed = rank_positions([Grid([0, 1]), Grid([2, 3])], 4, 8)
    assert reader_classes(["a", "b", "a", "b"], consumed, 8) == [0, 0, 1, 1] * 2
    assert reader_classes(["a", "b", "b", "a"], consumed, 8) == [0, 0, 0, 0] * 2  # both hosts read every block

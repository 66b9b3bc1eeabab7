"""Per-sample costs of a graph with two generators: each generator priced by its own targets and
its own family's terms; reordering and the ``balance/<generator>_*`` figures see it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from disttrain_ds.cost.graph_costs import GraphCosts
from disttrain_ds.families.dit.estimates import forward_flops
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.reorder.balance import dp_balance, module_columns
from disttrain_ds.reorder.inter import reorder_batch
from disttrain_ds.runtime.setup import cost_model
from disttrain_ds.samples import GenShape, PackedSample, ShapeSpec, SpecialTokens

SPECIAL = SpecialTokens.after(256, generators=2)
SEQ = 64


class FirstGeneratorPricing(GraphCosts):
    """The pricing before generators had their own: every generator costed from the first one's
    targets and terms (the negative control)."""

    def module_cost(self, name, s):
        return self.model.module_cost(self.kinds[name], s)

    def costs(self, samples):
        return np.array([[self.module_cost(n, s) for n in self.kinds] for s in samples]).reshape(-1, len(self.kinds))


def _sample(i: int, painter: int, sketcher: int, text: int = 20) -> PackedSample:
    """A one-document sample with ``painter`` 16 x 16 RGB and ``sketcher`` 8 x 8 two-channel targets."""
    ids = [5] * text
    for k, n, q in ((0, painter, 4), (1, sketcher, 2)):
        ids += ([SPECIAL.boi] + [SPECIAL.query(k)] * q + [SPECIAL.eoi]) * n
    ids.append(SPECIAL.eod)
    used = len(ids)
    t = torch.tensor(ids + [SPECIAL.pad] * (SEQ - used))
    return PackedSample(t, t.clone(), [], [torch.zeros(painter, 3, 16, 16), torch.zeros(sketcher, 2, 8, 8)], i, (used,))


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("tiny_two_gen")


def test_each_generator_is_priced_by_its_own_targets_and_family(recipe):
    costs = cost_model(recipe)
    sketcher = recipe.model.modules["sketcher"]
    stats = _sample(0, painter=0, sketcher=2).stats(8, SPECIAL)
    assert stats.gens == ((0, 0), (2, 8))
    assert costs.module_cost("painter", stats) == 0.0
    # The DiT's terms price an image at its own resolution at exactly its forward FLOPs.
    assert costs.module_cost("sketcher", stats) == pytest.approx(2 * forward_flops(sketcher), rel=1e-9)
    both = _sample(0, painter=1, sketcher=0).stats(8, SPECIAL)
    assert costs.module_cost("sketcher", both) == 0.0 and costs.module_cost("painter", both) > 0
    # Negative control: the old pricing sees the painter's targets in the sketcher's column.
    old = FirstGeneratorPricing(costs.own["painter"], costs.kinds)
    assert old.module_cost("sketcher", stats) == 0.0
    assert old.module_cost("sketcher", both) == old.module_cost("painter", both)


def _shape(costs) -> ShapeSpec:
    return ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4), GenShape(8, 2, 2)), dp_size=2, micro_batch=2,
                     cost_model=costs)


def test_reordering_evens_a_batch_whose_imbalance_is_only_in_the_second_generator(recipe):
    costs = cost_model(recipe)
    # Documents of 25, 25, 5 and 35 tokens make {0, 1} | {2, 3} the even LLM split (25^2 + 25^2 =
    # 5^2 + 35^2), which puts both sketcher-heavy samples (0 and 1) on one DP rank unless the
    # sketcher's own targets are priced.
    samples = [_sample(0, 0, 3, text=12), _sample(1, 0, 3, text=12), _sample(2, 0, 0, text=4),
               _sample(3, 0, 0, text=34)]
    assert [s.doc_lens for s in samples] == [(25,), (25,), (5,), (35,)]
    cols = module_columns(costs)

    def sketcher_max(pricing) -> float:
        out = reorder_batch(samples, _shape(pricing), SPECIAL)
        assert sorted(s.sample_id for s in out) == [0, 1, 2, 3]
        per = costs.costs([s.stats(8, SPECIAL) for s in out])
        return dp_balance(per, 4, {"vision": 1, "painter": 2, "sketcher": 2}, cols)["balance/sketcher_load_max"]

    assert sketcher_max(costs) == pytest.approx(1.0)
    assert sketcher_max(FirstGeneratorPricing(costs.own["painter"], costs.kinds)) == pytest.approx(2.0)


def test_balance_figures_of_the_second_generator_reflect_its_own_targets(recipe):
    costs = cost_model(recipe)
    samples = [_sample(0, 1, 2), _sample(1, 1, 0)]
    dps = {"vision": 1, "painter": 2, "sketcher": 2}
    new = dp_balance(costs.costs([s.stats(8, SPECIAL) for s in samples]), 2, dps, module_columns(costs))
    assert new["balance/painter_load_max"] == pytest.approx(1.0)
    assert new["balance/sketcher_load_max"] == pytest.approx(2.0) and new["balance/sketcher_load_min"] == 0.0
    assert new["balance/sketcher_load_mean"] == pytest.approx(forward_flops(recipe.model.modules["sketcher"]), rel=1e-9)
    old_costs = FirstGeneratorPricing(costs.own["painter"], costs.kinds)
    old = dp_balance(old_costs.costs([s.stats(8, SPECIAL) for s in samples]), 2, dps, module_columns(costs))
    assert old["balance/sketcher_load_max"] == pytest.approx(1.0)  # the painter's figures, not its own


def test_own_terms_must_name_modules_of_the_graph():
    from disttrain_ds.cost.model import CostModel

    m = CostModel.paper_mllm()
    with pytest.raises(ValueError, match="does not have"):
        GraphCosts(m, {"vision": "encoder", "llm": "llm", "painter": "generator"}, {"ear": m})
    g = GraphCosts(m, {"llm": "llm", "a": "generator", "b": "generator"},
                   {"b": dataclasses.replace(m, gen_per_image=1.0, gen_per_latent=0.0, gen_per_latent_sq=0.0)})
    stats = _sample(0, 2, 3).stats(8, SPECIAL)
    assert g.module_cost("b", stats) == 3.0 and g.module_cost("a", stats) == m.generator_cost(stats)

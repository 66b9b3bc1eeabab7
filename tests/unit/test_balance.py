"""DP balance figures use the runtime's contiguous split and show reordering's effect."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain_ds.reorder.balance import dp_balance
from disttrain_ds.reorder.intra import build_microbatches

COLUMNS = {"encoder": 0, "generator": 2}  # cost columns of a three-module graph


def test_balance_uses_contiguous_blocks_per_slot():
    costs = np.zeros((4, 3))
    costs[:, 0] = [1, 3, 2, 2]  # encoder costs; slots of 2 samples, dp 2: one sample per replica
    out = dp_balance(costs, slot=2, dp={"encoder": 2, "generator": 1}, columns=COLUMNS)
    assert out["balance/encoder_load_mean"] == 2.0
    # slot 0: loads 1 and 3 (max 1.5, min 0.5 of the mean); slot 1: 2 and 2 (1.0, 1.0)
    assert out["balance/encoder_load_max"] == pytest.approx(1.25) and out["balance/encoder_load_min"] == pytest.approx(0.75)
    assert out["balance/generator_load_max"] == 1.0  # no generator work: trivially balanced


def test_intra_reordering_brings_max_load_towards_mean():
    rng = np.random.default_rng(0)
    costs = np.zeros((64, 3))
    costs[:, 0] = rng.lognormal(0, 1, 64)
    before = dp_balance(costs, slot=16, dp={"encoder": 8, "generator": 1}, columns=COLUMNS)
    groups = build_microbatches(costs[:, 0], 8, 4)  # 4 microbatches of 8 replicas x 2 samples
    order = [i for mb in groups for rank in mb for i in rank]
    after = dp_balance(costs[order], slot=16, dp={"encoder": 8, "generator": 1}, columns=COLUMNS)
    assert after["balance/encoder_load_max"] < before["balance/encoder_load_max"]
    assert after["balance/encoder_load_mean"] == pytest.approx(before["balance/encoder_load_mean"])

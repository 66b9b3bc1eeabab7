"""Encoders without TP on CUDA with items of mixed lengths: every block runs all packed rows at once
with one flex attention call (``models/packed_tp.py::on_items``) and computes the library's layers
run per item length, gradients included; the control attends the rows as one item."""

from __future__ import annotations

import pytest
import torch
from tp_seq_vit_cases import MIXED, whole_rows_case  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.gpu

FAMILIES = [("vit", MIXED), ("clip", MIXED), ("siglip", MIXED), ("whisper", (12, 20, 14))]


@pytest.mark.parametrize("family, sides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_encoder_blocks_on_cuda_attend_mixed_items_in_one_flex_call_as_the_library_layers(family, sides):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # the patch embedding in float32
        got = whole_rows_case(family, sides, device="cuda")
        control = whole_rows_case(family, sides, device="cuda", one_item=True)
    assert got["out_err"] < 1e-4
    assert got["grad_err"] < 1e-4, f"{got['where']} differs by {got['grad_err']:.2e}"
    assert control["out_err"] > 1e-3

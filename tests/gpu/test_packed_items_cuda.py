"""Encoders without TP on CUDA with items of mixed lengths: every block runs all packed rows at once
with one attention call (``models/packed_tp.py::on_items``: flex in float32, varlen flash in
bfloat16) and computes the library's layers
run per item length, gradients included; the control attends the rows as one item."""

from __future__ import annotations

import pytest
import torch
from tp_seq_vit_cases import MIXED, whole_rows_case  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.gpu

FAMILIES = [("vit", MIXED), ("clip", MIXED), ("siglip", MIXED), ("whisper", (12, 20, 14))]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["flex", "varlen"])
@pytest.mark.parametrize("family, sides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_encoder_blocks_on_cuda_attend_mixed_items_in_one_call_as_the_library_layers(family, sides, dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # the patch embedding in float32
        got = whole_rows_case(family, sides, device="cuda", dtype=dtype)
        control = whole_rows_case(family, sides, device="cuda", one_item=True)
    assert got["out_err"] < tol  # the head's outputs are normalised: O(1)
    assert got["grad_err"] < tol, f"{got['where']} differs by {got['grad_err']:.2e}"
    # Control (float32, where the tiny encoders' difference stands clear of rounding): the rows
    # attending as one item give another output.
    assert control["out_err"] > 1e-3

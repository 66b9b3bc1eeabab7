"""Encoders' items of mixed lengths without TP (``models/packed_tp.py``): the blocks written out over
all packed rows at once compute the library's layers run per item length, and attention over the
items in one flex call equals attention per length, compiled once for every microbatch's lengths."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import flex_attention
from tp_seq_vit_cases import MIXED, whole_rows_case  # tests/ is on sys.path under pytest

from disttrain_ds.models import doc_mask
from disttrain_ds.models.packed_tp import attend_items, items_path

FAMILIES = [("vit", MIXED), ("clip", MIXED), ("siglip", MIXED), ("whisper", (12, 20, 14))]


@pytest.mark.parametrize("family, sides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_encoder_blocks_over_all_packed_rows_give_the_library_layers_output_and_every_gradient(family, sides):
    got = whole_rows_case(family, sides)
    assert got["out_err"] < 1e-5
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5, abs=1e-6)
    assert got["grad_err"] < 1e-5, f"{got['where']} differs by {got['grad_err']:.2e}"
    # Control: the same rows attending as one item give another output.
    assert whole_rows_case(family, sides, one_item=True)["out_err"] > 1e-3


def _qkv(sizes: list[int], heads: int = 4, head_dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(sizes))
    return torch.randn(sum(sizes), 3 * heads * head_dim, generator=g)


def test_flex_attention_over_packed_items_equals_attention_per_length_and_compiles_once(monkeypatch):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(doc_mask, "_FLEX", {True: torch.compile(flex_attention, dynamic=True, backend=counter)})
    # Microbatches of different lengths and totals (flex's CPU kernel has a forward only), each over
    # one mask block (a microbatch within one block compiles once more: sizes of 1 are specialised).
    graphs = []
    for sizes, prescale in [([40, 60, 33, 50], False), ([50, 50, 197], True), ([3, 200, 90], False)]:
        qkv = _qkv(sizes)
        spans = torch.tensor(sizes)
        with torch.no_grad():
            flex = attend_items(qkv, spans, 8, 0.0, 0.3, prescale, path="flex")
            groups = attend_items(qkv, spans, 8, 0.0, 0.3, prescale, path="groups")
            one = attend_items(qkv, torch.tensor([sum(sizes)]), 8, 0.0, 0.3, prescale, path="flex")
        assert flex.shape == (sum(sizes), 32)
        assert float((flex - groups).abs().max()) < 1e-5, sizes
        assert float((one - groups).abs().max()) > 1e-2  # control: the rows as one item attend otherwise
        graphs.append(counter.frame_count)
    assert graphs[0] > 0 and graphs == graphs[:1] * 3  # compiled at the first microbatch, never again


def test_items_attend_in_one_flex_call_only_on_cuda_with_mixed_lengths_and_no_dropout():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert items_path([17, 5, 17], 0.0, cuda) == "flex"
    assert items_path([17, 17, 17], 0.0, cuda) == "groups"  # one batched SDPA, no copy
    assert items_path([17, 5, 17], 0.1, cuda) == "groups"  # flex has no dropout
    assert items_path([17, 5, 17], 0.0, cpu) == "groups"  # nor a backward off CUDA


def test_flex_attention_over_items_with_dropout_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^attention over packed items through flex has no dropout, got 0\.1$"):
        attend_items(_qkv([3, 5]), torch.tensor([3, 5]), 8, 0.1, 0.3, path="flex")

"""Encoders' items of mixed lengths without TP (``models/packed_tp.py``): the blocks written out over
all packed rows at once compute the library's layers run per item length, and attention over the
items in one flex call equals attention per length, compiled once for every microbatch's lengths."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import flex_attention
from tp_seq_vit_cases import MIXED, whole_rows_case  # tests/ is on sys.path under pytest

from disttrain_ds.models import doc_mask
from disttrain_ds.models.item_attention import attend_items, item_offsets, items_path

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


def test_items_attend_in_one_call_only_on_cuda_with_mixed_lengths_and_no_dropout():
    cuda, cpu, bf16, fp32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    assert items_path([17, 5, 17], 0.0, cuda, bf16) == "varlen"  # flash over variable lengths
    assert items_path([17, 5, 17], 0.0, cuda, fp32) == "flex"  # flash computes in half precision only
    assert items_path([17, 17, 17], 0.0, cuda, bf16) == "groups"  # one batched SDPA, no copy
    assert items_path([17, 5, 17], 0.1, cuda, bf16) == "groups"  # neither kernel has dropout
    assert items_path([17, 5, 17], 0.0, cpu, bf16) == "groups"  # nor a backward off CUDA


calls: list[dict] = []
"""What each call of the stand-in kernel got."""


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1),
                      enable_gqa=False):
    """What flash's varlen kernel computes, per its contract: SDPA within each [cu[i], cu[i+1]) span."""
    calls.append({"shapes": [tuple(t.shape) for t in (q, k, v)], "cu": cu_q.tolist(), "same": cu_k is cu_q,
                  "dtype": cu_q.dtype, "max": (max_q, max_k), "scale": scale,
                  "storages": len({t.untyped_storage().data_ptr() for t in (q, k, v)})})
    bounds = cu_q.tolist()
    parts = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale).transpose(0, 1)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts)


def test_varlen_attention_over_items_gets_their_offsets_and_the_rows_as_views(monkeypatch):
    monkeypatch.setattr(doc_mask, "varlen_attn", _varlen_reference)
    calls.clear()
    sizes = [17, 5, 17, 10]
    qkv, spans = _qkv(sizes), torch.tensor(sizes)
    got = attend_items(qkv, spans, 8, 0.0, 0.3, True, path="varlen")  # Whisper's prescale: scaled in the kernel
    want = attend_items(qkv, spans, 8, 0.0, 0.3, True, path="groups")
    assert float((got - want).abs().max()) < 1e-5 and got.shape == (49, 32)
    (call,) = calls
    assert call["cu"] == [0, 17, 22, 39, 49] and call["same"] and call["dtype"] == torch.int32
    assert call["max"] == (17, 17) and call["scale"] == 0.3
    assert call["shapes"] == [(49, 4, 8)] * 3 and call["storages"] == 1  # [R, heads, d] views of the joined rows
    assert item_offsets(sizes, torch.device("cpu")) is item_offsets(sizes, torch.device("cpu"))  # once per microbatch
    # Control: offsets of other items give another output.
    other = attend_items(qkv, torch.tensor([22, 27]), 8, 0.0, 0.3, True, path="varlen")
    assert float((other - want).abs().max()) > 1e-2


def test_one_call_attention_over_items_with_dropout_is_refused_in_one_line():
    for path in ("flex", "varlen"):
        with pytest.raises(ValueError, match=rf"^attention over packed items through {path} has no dropout, got 0\.1$"):
            attend_items(_qkv([3, 5]), torch.tensor([3, 5]), 8, 0.1, 0.3, path=path)

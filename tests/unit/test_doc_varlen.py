"""Document attention through flash attention over variable lengths (``doc_attention: varlen``): the
call it makes (the spans' offsets, the longest span, causal, grouped-query heads, views of the
projections) against a stand-in that computes the kernel's contract, built once per microbatch;
and where it is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_tp_sequence import REPO  # tests/unit is on sys.path under pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.models import doc_mask
from disttrain_ds.models.doc_mask import doc_attention, doc_attention_kwargs, doc_attention_path, doc_spans
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.samples import doc_ids

calls: list[dict] = []
"""What each call of the stand-in kernel got."""


def _stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1), enable_gqa=False):
    """Flash's varlen kernel by its contract: SDPA within each [cu[i], cu[i+1]) span of the rows,
    causal for window (-1, 0)."""
    calls.append({"shapes": [tuple(t.shape) for t in (q, k, v)], "cu": cu_q.tolist(), "same": cu_k is cu_q,
                  "dtype": cu_q.dtype, "max": (max_q, max_k), "scale": scale, "window": window_size,
                  "gqa": enable_gqa, "views": all(t._base is not None for t in (q, k, v))})
    bounds = cu_q.tolist()
    parts = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale,
                                            is_causal=window_size == (-1, 0), enable_gqa=enable_gqa).transpose(0, 1)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts)


def _qkv(b: int, s: int) -> list[torch.Tensor]:
    """q [B, 4, S, 8], k / v [B, 2, S, 8] in bfloat16, as the block passes them: views of [B, S, H, D]."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, h, 8, generator=g).to(torch.bfloat16).transpose(1, 2) for h in (4, 2, 2)]


@pytest.fixture
def kernel(monkeypatch):
    calls.clear()
    monkeypatch.setattr(doc_mask, "varlen_attn", _stand_in)
    monkeypatch.setattr(doc_mask, "doc_attention_path", lambda choice, device: choice)  # as on CUDA


def test_varlen_document_attention_passes_the_spans_offsets_and_equals_the_spans_path(kernel):
    docs = torch.stack([doc_ids((5, 3, 5), 16), doc_ids((2, 14), 16)])  # padding at the end of row 0
    kwargs = doc_attention_kwargs(docs, "varlen")
    assert kwargs["doc_offsets"].tolist() == [0, 5, 8, 13, 16, 18, 32] and kwargs["doc_longest"] == 14
    assert kwargs["doc_offsets"].dtype == torch.int32
    assert doc_attention_kwargs(docs, "varlen") is kwargs  # built once per microbatch
    q, k, v = _qkv(2, 16)
    out, _ = doc_attention(None, q, k, v, None, scaling=0.3, **kwargs)
    want, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_spans=doc_spans(docs))
    assert out.shape == (2, 16, 4, 8) and float((out.float() - want.float()).abs().max()) < 2e-2  # bf16 roundings
    (call,) = calls
    assert call["shapes"] == [(32, 4, 8), (32, 2, 8), (32, 2, 8)] and call["views"]  # rows, no copy
    assert call["same"] and call["max"] == (14, 14) and call["scale"] == 0.3
    assert call["window"] == (-1, 0) and call["gqa"]  # causal; two query heads per KV head
    # Control: other documents' offsets give another output.
    other = doc_attention_kwargs(torch.stack([doc_ids((8, 5), 16), doc_ids((9, 7), 16)]), "varlen")
    wrong, _ = doc_attention(None, q, k, v, None, scaling=0.3, **other)
    assert float((wrong.float() - want.float()).abs().max()) > 0.1


def test_varlen_leaves_rows_of_one_whole_document_to_plain_causal_attention(kernel):
    assert doc_attention_kwargs(torch.stack([doc_ids((16,), 16)] * 2), "varlen") == {"doc_whole": True}


def test_varlen_refuses_float32_a_cpu_device_and_dropout_in_one_line(kernel, monkeypatch):
    docs = torch.stack([doc_ids((5, 11), 16)])
    kwargs = doc_attention_kwargs(docs, "varlen")
    q, k, v = (t.float() for t in _qkv(1, 16))
    with pytest.raises(ConfigError, match=r"^doc_attention: varlen computes in half precision, got torch\.float32; "):
        doc_attention(None, q, k, v, None, **kwargs)
    with pytest.raises(ValueError, match=r"through varlen has no dropout, got 0\.1$"):
        doc_attention(None, *_qkv(1, 16), None, dropout=0.1, **kwargs)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"^doc_attention: varlen needs a CUDA device"):
        doc_attention_path("varlen", torch.device("cpu"))


def test_a_recipe_asking_for_varlen_needs_bf16_and_says_so_naming_the_field():
    with pytest.raises(ConfigError, match=r"'model\.llm\.doc_attention' varlen runs flash attention, which computes in "
                                          r"bf16: set train\.dtype=bf16"):
        load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["model.llm.doc_attention=varlen"])
    assert load_recipe(REPO / "recipes" / "tiny_cpu.yaml",
                       ["model.llm.doc_attention=varlen", "train.dtype=bf16"]).train.dtype == "bf16"

"""Document attention through flex attention: its block mask is the document mask, the path
follows the device, and every block of a microbatch shares one mask."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from disttrain_ds.errors import ConfigError
from disttrain_ds.models import doc_mask
from disttrain_ds.models.doc_mask import (
    doc_attention,
    doc_attention_kwargs,
    doc_attention_path,
    doc_block_mask,
    doc_causal_mask,
    doc_mask_mod,
    doc_runs,
    doc_spans,
)
from disttrain_ds.models.layers import Sequential
from disttrain_ds.samples import doc_ids

LAYOUTS = [
    ([(5, 3, 5), (2, 14)], 16),  # padding at the end of row 0, none in row 1
    ([(5, 3, 5), (2, 14)], 18),  # S not a multiple of the block: flex pads the last block
    ([(8, 8), (16,)], 16),  # documents on block edges: full blocks
    ([(1,) * 7, (3, 4, 5)], 13),
]


def _docs(lens, s) -> torch.Tensor:
    return torch.stack([doc_ids(row, s) for row in lens])


def test_runs_number_the_spans_of_each_row():
    docs = _docs([(3, 2), (1, 5)], 6)
    assert doc_runs(docs).tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert [int((doc_runs(docs)[i] == r).sum()) for i, r in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]] == \
        doc_spans(docs).tolist()


@pytest.mark.parametrize("lens,s", LAYOUTS)
def test_the_mask_mod_is_the_document_mask_element_by_element(lens, s):
    docs = _docs(lens, s)
    mod = doc_block_mask(docs, 4).mask_mod
    b, q, kv = (torch.arange(n).view(*shape) for n, shape in [(len(lens), (-1, 1, 1)), (s, (1, -1, 1)), (s, (1, 1, -1))])
    direct = mod(b, torch.zeros(()), q, kv)
    assert torch.equal(direct, doc_causal_mask(docs)[:, 0])
    assert torch.equal(create_mask(mod, len(lens), 1, s, s, device="cpu"), doc_causal_mask(docs))
    # Negative control: every layout here has a row of several runs, so the mask is not plain causal.
    assert not torch.equal(direct, (q >= kv).expand_as(direct))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "items"])
@pytest.mark.parametrize("lens,s", LAYOUTS)
def test_the_block_mask_equals_flex_attentions_own_from_the_full_mask(lens, s, causal):
    docs = _docs(lens, s)
    ours = doc_block_mask(docs, 4, causal)
    ref = create_block_mask(doc_mask_mod(doc_runs(docs), causal), len(lens), None, s, s, device="cpu", BLOCK_SIZE=4)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.seq_lengths == (s, s) and ours.BLOCK_SIZE == (4, 4)
    if s == 16 and lens[0] == (8, 8):  # the layouts exercise full, partial and skipped blocks
        assert int(ours.full_kv_num_blocks.sum()) > 0 and int(ours.kv_num_blocks.sum()) < 2 * 10


def test_flex_forward_on_cpu_equals_the_spans_and_the_masked_sdpa(monkeypatch):
    # Compiling flex on CPU takes minutes; eager flex runs the same block mask (forward only on CPU).
    monkeypatch.setattr(doc_mask, "_FLEX", {False: flex_attention, True: flex_attention})
    g = torch.Generator().manual_seed(1)
    docs = _docs([(5, 3, 5), (2, 14)], 16)
    q = torch.randn(2, 4, 16, 8, generator=g)
    k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(2))  # grouped-query heads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager flex's "use torch.compile" advice
        out, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_blocks=doc_block_mask(docs, 4))
    spans, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_spans=doc_spans(docs))
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=doc_causal_mask(docs), scale=0.3)
    torch.testing.assert_close(out, spans, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    # Negative control: flex under the wrong layout's mask is another function.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wrong, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_blocks=doc_block_mask(_docs([(8, 5), (9, 7)], 16), 4))
    assert (wrong - out).abs().max() > 1e-2


def test_doc_attention_takes_exactly_one_of_spans_blocks_and_whole():
    q = torch.zeros(1, 2, 4, 8)
    docs = _docs([(4,)], 4)
    for kwargs in ({}, {"doc_spans": doc_spans(docs), "doc_blocks": doc_block_mask(docs)},
                   {"doc_spans": doc_spans(docs), "doc_whole": True}):
        with pytest.raises(ValueError, match="takes one of doc_spans, doc_blocks, doc_offsets, doc_whole"):
            doc_attention(None, q, q, q, None, **kwargs)
    with pytest.raises(ValueError, match="no dropout"):
        doc_attention(None, q, q, q, None, dropout=0.1, doc_blocks=doc_block_mask(docs))


def test_auto_is_flex_on_cuda_and_spans_elsewhere():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert doc_attention_path("auto", cuda) == "flex" and doc_attention_path("auto", cpu) == "spans"
    assert doc_attention_path("spans", cuda) == "spans" and doc_attention_path("flex", cuda) == "flex"
    docs = _docs([(3, 2)], 6)
    assert set(doc_attention_kwargs(docs)) == {"doc_spans"}  # on CPU
    spans = doc_attention_kwargs(docs)["doc_spans"]
    assert spans.tolist() == [3, 2, 1] and spans.device.type == "cpu"  # read to the host once, for every block


def test_auto_keeps_plain_causal_sdpa_for_rows_of_one_whole_document(monkeypatch):
    # Pretend CUDA: auto's device rule says flex; a microbatch without packing still takes plain
    # causal SDPA over its rows, an explicit flex does not.
    monkeypatch.setattr(doc_mask, "doc_attention_path", lambda choice, device: "flex" if choice != "spans" else "spans")
    whole = _docs([(6,), (6,)], 6)
    packed, padded = _docs([(3, 3), (6,)], 6), _docs([(4,), (6,)], 6)
    assert doc_attention_kwargs(whole, "auto") == {"doc_whole": True}
    assert doc_attention_kwargs(whole, "spans") == {"doc_whole": True}
    assert set(doc_attention_kwargs(whole, "flex")) == {"doc_blocks"}
    assert set(doc_attention_kwargs(packed, "auto")) == {"doc_blocks"}
    assert set(doc_attention_kwargs(padded, "auto")) == {"doc_blocks"}  # padding is a span of its own


def test_flex_on_cpu_is_a_one_line_error_naming_the_setting(tiny_spec):
    with pytest.raises(ConfigError, match=r"^doc_attention: flex needs a CUDA device .* auto or spans$"):
        doc_attention_path("flex", torch.device("cpu"))
    spec = tiny_spec.with_changes("llm", doc_attention="flex")
    llm = Sequential([d.build() for d in spec.layers("llm")])
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ConfigError, match="doc_attention: flex needs a CUDA device"):
        llm((ids, torch.zeros(0, spec.llm.hidden_size), _docs([(5,)], 8)))


def test_recipes_take_the_setting_and_refuse_other_values():
    from test_checkpoint_init import load_recipe_tiny

    assert load_recipe_tiny([]).model.llm.doc_attention == "auto"
    assert load_recipe_tiny(["model.llm.doc_attention=spans"]).model.llm.doc_attention == "spans"
    with pytest.raises(ConfigError,
                       match=r"'model.llm.doc_attention' must be one of auto \| spans \| flex \| varlen, got 'mask'"):
        load_recipe_tiny(["model.llm.doc_attention=mask"])


def test_every_block_of_a_microbatch_shares_one_mask(tiny_spec, monkeypatch):
    built = []
    real = doc_mask.doc_spans
    monkeypatch.setattr(doc_mask, "doc_spans", lambda d: built.append(d) or real(d))
    llm = Sequential([d.build() for d in tiny_spec.layers("llm")])
    assert tiny_spec.llm.layers > 1
    ids = torch.zeros(1, 12, dtype=torch.long)
    rows = torch.zeros(0, tiny_spec.llm.hidden_size)
    docs = _docs([(5, 4)], 12)
    with torch.no_grad():
        llm((ids, rows, docs))
        assert len(built) == 1  # once, not once per block
        llm((ids, rows, docs.clone()))  # the next microbatch: built again
        assert len(built) == 2
        docs[0, 5:] = 7  # the same tensor changed in place is not the same layout
        llm((ids, rows, docs))
        assert len(built) == 3 and real(built[-1]).tolist() == [5, 7]


def test_rows_of_one_whole_document_attend_as_the_spans_do():
    # doc_whole is plain causal SDPA over each row: the spans path's function when every row is one
    # document (grouped-query heads, several rows); control: on packed rows it is not.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(2))
    whole = _docs([(12,), (12,)], 12)
    assert doc_attention_kwargs(whole) == {"doc_whole": True}
    out, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_whole=True)
    spans, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_spans=doc_spans(whole))
    torch.testing.assert_close(out, spans, rtol=1e-5, atol=1e-6)
    packed, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_spans=doc_spans(_docs([(5, 7), (12,)], 12)))
    assert (packed - out).abs().max() > 1e-2

"""Document masking: a packed document attends only to itself, its positions restart, padding is nobody's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.source import SyntheticSource, labels_for
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate
from disttrain_ds.models.doc_mask import doc_attention, doc_causal_mask, doc_positions, doc_spans
from disttrain_ds.models.layers import Sequential
from disttrain_ds.samples import IGNORE_INDEX, NO_DOC, GenShape, ShapeSpec, SpecialTokens, doc_ids


def test_doc_ids_number_the_documents_and_leave_the_padding_out():
    assert doc_ids((3, 2), 7).tolist() == [0, 0, 0, 1, 1, NO_DOC, NO_DOC]
    assert doc_ids((4,), 4).tolist() == [0, 0, 0, 0]
    for bad in ((), (3, 0), (5, 3)):
        with pytest.raises(ValueError, match=r"sample 9: doc_lens .* summing to at most seq_len 7"):
            doc_ids(bad, 7, where="sample 9")


def test_positions_restart_at_each_document():
    docs = doc_ids((3, 2, 1), 8).unsqueeze(0)
    assert doc_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_mask_is_causal_inside_each_document_only():
    mask = doc_causal_mask(doc_ids((2, 2), 5).unsqueeze(0))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [0, 0, 1, 0, 0],
                    [0, 0, 1, 1, 0],
                    [0, 0, 0, 0, 1]]  # padding sees only padding: no softmax over an empty row


def test_spans_are_the_runs_of_each_row_and_never_join_two_rows():
    docs = torch.stack([doc_ids((3, 2), 6), doc_ids((1, 5), 6)])  # row 0 ends in padding, row 1 does not
    assert doc_spans(docs).tolist() == [3, 2, 1, 1, 5]
    same = torch.stack([doc_ids((6,), 6), doc_ids((6,), 6)])  # one document per row: two spans, not one
    assert doc_spans(same).tolist() == [6, 6]


def test_attention_per_document_span_equals_sdpa_under_the_document_mask():
    g = torch.Generator().manual_seed(1)
    docs = torch.stack([doc_ids((5, 3, 5), 16), doc_ids((2, 14), 16)])
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, generator=g, requires_grad=True) for _ in range(2))  # grouped-query heads
    out, _ = doc_attention(None, q, k, v, None, scaling=0.3, doc_spans=doc_spans(docs))
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=doc_causal_mask(docs), scale=0.3)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref.transpose(1, 2) * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Negative control: the plain causal mask over the pack is another function.
    crossed = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=0.3)
    assert (crossed.transpose(1, 2) - out).abs().max() > 1e-2


def _llm(spec, family: str) -> Sequential:
    spec = spec.with_changes("llm", family=family)
    return Sequential([d.build() for d in spec.layers("llm")])


def _pack(docs: list[torch.Tensor], seq_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(docs + [torch.full((seq_len - sum(len(d) for d in docs),), pad)])
    return ids.unsqueeze(0), doc_ids(tuple(len(d) for d in docs), seq_len).unsqueeze(0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_documents_logits_do_not_depend_on_the_document_before_it(tiny_spec, family):
    llm, sp, h = _llm(tiny_spec, family), tiny_spec.special, tiny_spec.llm.hidden_size
    g = torch.Generator().manual_seed(0)
    first = torch.randint(0, 200, (9,), generator=g)
    other_first = torch.randint(0, 200, (14,), generator=g)  # another length too
    # The second document holds an image: its patch embeddings belong to it.
    second = torch.cat([torch.randint(0, 200, (5,), generator=g), torch.tensor([sp.boi, sp.image, sp.image, sp.eoi]),
                        torch.randint(0, 200, (6,), generator=g), torch.tensor([sp.eod])])
    patches = torch.randn(2, h, generator=g)
    seq = 40

    def logits_of_second(before: torch.Tensor, one_doc: bool = False) -> torch.Tensor:
        ids, docs = _pack([before, second], seq, sp.pad)
        if one_doc:  # the mask disabled: the pack attends as one document
            docs = torch.where(docs == NO_DOC, docs, torch.zeros_like(docs))
        logits, _ = llm((ids, patches, docs))
        return logits[0, len(before):len(before) + len(second)]

    with torch.no_grad():
        ref = logits_of_second(first)
        torch.testing.assert_close(logits_of_second(other_first), ref, rtol=0, atol=1e-5)
        alone_ids, alone_docs = _pack([second], seq, sp.pad)
        torch.testing.assert_close(llm((alone_ids, patches, alone_docs))[0][0, :len(second)], ref, rtol=0, atol=1e-5)
        # Negative control: attending across the pack, the document before it changes the logits.
        crossed = logits_of_second(first, one_doc=True)
        assert (crossed - logits_of_second(other_first, one_doc=True)).abs().max() > 1e-3


def test_no_gradient_crosses_documents_or_comes_from_padding(tiny_spec):
    llm, sp, h = _llm(tiny_spec, "llama"), tiny_spec.special, tiny_spec.llm.hidden_size
    first = torch.tensor([sp.boi, sp.image, sp.eoi, 5, 6, sp.eod])
    second = torch.tensor([sp.boi, sp.image, sp.eoi, 7, 8, 9, sp.eod])
    ids, docs = _pack([first, second], 20, sp.pad)
    patches = torch.randn(2, h, requires_grad=True)
    logits, _ = llm((ids, patches, docs))
    assert torch.isfinite(logits).all()
    logits[0, 6:13].sum().backward()  # the second document's outputs only
    assert patches.grad[0].abs().max() == 0 and patches.grad[1].abs().max() > 0


def test_blocks_feed_rotary_positions_that_restart_at_each_document(tiny_spec):
    llm, sp = _llm(tiny_spec, "llama"), tiny_spec.special
    ids, docs = _pack([torch.arange(4), torch.arange(3)], 10, sp.pad)
    seen = []
    block = llm.layers[1]
    block.rotary.register_forward_hook(lambda mod, args, out: seen.append(args[1].tolist()))
    llm((ids, torch.zeros(0, tiny_spec.llm.hidden_size), docs))
    assert seen == [[[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]]


def test_collate_carries_each_samples_documents_to_the_reference(tiny_spec, tiny_samples):
    mb = collate(tiny_samples, BatchNorms.of(tiny_samples, 1), tiny_spec)
    for row, s in zip(mb.doc_ids, tiny_samples):
        assert row.tolist() == doc_ids(s.doc_lens, len(s.input_ids)).tolist()
        assert bool((row == NO_DOC).eq(s.input_ids == tiny_spec.special.pad).all())
    out = ReferenceMLLM(tiny_spec)(mb)
    assert torch.isfinite(out["loss"])
    broken = dataclasses.replace(tiny_samples[0], doc_lens=())
    with pytest.raises(ValueError, match="sample .*: doc_lens"):
        collate([broken], BatchNorms.of([broken], 1), tiny_spec)


SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))


def _docs(s) -> list[torch.Tensor]:
    out, start = [], 0
    for n in s.doc_lens:
        out.append(s.input_ids[start:start + n])
        start += n
    return out


@pytest.mark.parametrize("max_images", [3, 0])
def test_synthetic_samples_are_one_or_more_real_documents(max_images):
    cfg = DataConfig(seq_len=128, image_sizes=[16, 24, 32], max_images=max_images)
    src = SyntheticSource(cfg, SHAPE, 8, seed=3)
    samples = [s for step in range(3) for s in src.global_batch(step)]
    counts = {len(s.doc_lens) for s in samples}
    assert 1 in counts and max(counts) > 1
    for s in samples:
        assert sample_problems(s, src.special, 8, 128, (GenShape(16, 3, 4),)) == []
        assert all(int(d[-1]) == src.special.eod and int((d == src.special.eod).sum()) == 1 for d in _docs(s))


def test_paper_stats_documents_each_end_with_eod():
    cfg = DataConfig(source="paper_stats", seq_len=2048, max_images=30, gen_images=[0, 4], gen_prob=0.3)
    src = build_source(cfg, SHAPE, 4, seed=3)
    samples = src.global_batch(0)
    assert max(len(s.doc_lens) for s in samples) > 1
    for s in samples:
        assert sample_problems(s, src.special, 8, 2048, (GenShape(16, 3, 4),)) == []
        assert all(int(d[-1]) == src.special.eod and int((d == src.special.eod).sum()) == 1 for d in _docs(s))


def test_validation_refuses_an_image_split_across_documents():
    src = SyntheticSource(DataConfig(seq_len=128, image_sizes=[16], max_images=1, gen_images=[0, 0]), SHAPE, 1, 0)
    s = src.global_batch(0)[0]
    cut = int((s.input_ids == src.special.image).nonzero()[0])  # inside the first image's placeholders
    bad = dataclasses.replace(s, doc_lens=(cut, sum(s.doc_lens) - cut))
    assert any("straddles two documents" in p for p in sample_problems(bad, src.special, 8, 128, (GenShape(16, 3, 4),)))
    assert sample_problems(s, src.special, 8, 128, (GenShape(16, 3, 4),)) == []


def test_a_documents_last_token_is_not_trained_to_predict_the_next_documents_first():
    sp = SpecialTokens.after(256)
    ids = torch.tensor([5, 6, sp.eod, 7, 8, sp.eod, sp.pad])
    labels = labels_for(ids, sp, (3, 3))
    # Inside a document: the next token. At each eod: nothing (the next document starts, or padding).
    assert labels.tolist() == [6, sp.eod, IGNORE_INDEX, 8, sp.eod, IGNORE_INDEX, IGNORE_INDEX]
    assert labels_for(ids, sp)[2] == 7  # without document lengths the stream's next token would be its label


@pytest.mark.parametrize("source", ["synthetic", "paper_stats", "mmc4"])
def test_no_label_crosses_a_document_boundary_and_the_norms_count_what_is_labelled(source, request):
    if source == "mmc4":
        path = request.getfixturevalue("fixtures_dir") / "mmc4_sample.jsonl"
        cfg = DataConfig(source="mmc4", path=str(path), seq_len=256, image_sizes=[16])
    else:
        cfg = DataConfig(source=source, seq_len=512 if source == "paper_stats" else 128, max_images=8)
    src = build_source(cfg, SHAPE, 4, seed=1)
    samples = [s for step in range(2) for s in src.global_batch(step)]
    assert max(len(s.doc_lens) for s in samples) > 1
    for s in samples:
        ends = torch.tensor(s.doc_lens).cumsum(0) - 1
        assert (s.labels[ends] == IGNORE_INDEX).all()
        assert sample_problems(s, src.special, 8, cfg.seq_len, (GenShape(16, 3, 4),)) == []
    labelled = sum(int((s.labels != IGNORE_INDEX).sum()) for s in samples)
    assert BatchNorms.of(samples, 1).text_tokens == labelled


def test_collate_pads_shorter_sequences_as_padding_that_nothing_attends_to_or_learns(tiny_spec, tiny_samples):
    """Sequences of their own lengths (data.max_seq_len) in one microbatch: the shorter rows end in
    pad tokens, ignored labels and NO_DOC, and each row's loss is the one it has alone."""
    short, other = tiny_samples[0], tiny_samples[1]
    n = int(other.input_ids.shape[0])
    pad = torch.full((n,), tiny_spec.special.pad, dtype=torch.long)
    longer = dataclasses.replace(other, input_ids=torch.cat([other.input_ids, pad]),
                                 labels=torch.cat([other.labels, torch.full((n,), IGNORE_INDEX)]))
    mb = collate([short, longer], BatchNorms.of([short, longer], 1), tiny_spec)
    assert mb.input_ids.shape == (2, 2 * n)
    assert (mb.input_ids[0, n:] == tiny_spec.special.pad).all() and (mb.labels[0, n:] == IGNORE_INDEX).all()
    assert (mb.doc_ids[0, n:] == NO_DOC).all()
    model = ReferenceMLLM(tiny_spec)
    with torch.no_grad():
        both = model(mb)["lm"]
        alone = [model(collate([s], BatchNorms.of([short, longer], 1), tiny_spec))["lm"] for s in (short, longer)]
    assert float(both) == pytest.approx(float(sum(alone)), rel=1e-5)

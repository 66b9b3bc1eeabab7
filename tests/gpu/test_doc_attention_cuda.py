"""Document attention on CUDA: the per-span SDPA path and the compiled flex attention path against
the masked reference and each other, alone and inside an LLM block."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.models.doc_mask import doc_attention, doc_attention_kwargs, doc_block_mask, doc_causal_mask, doc_spans
from disttrain_ds.samples import doc_ids

pytestmark = pytest.mark.gpu


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _docs(s: int = 1024) -> torch.Tensor:
    return torch.stack([doc_ids((300, 100, s - 424), s), doc_ids((s - 24,), s)]).cuda()  # padding in both rows


def _qkv(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1024, 64, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 1024, 64, generator=g).to("cuda", dtype).requires_grad_() for _ in range(2))
    return q, k, v


def _assert_near(a: torch.Tensor, b: torch.Tensor, tol: float, what: str):
    """Max difference within ``tol`` of the reference's largest value (no elementwise rtol holds
    near zero in bf16)."""
    diff, scale = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
    assert scale > 0 and diff <= tol * scale, f"{what}: max |diff| {diff:.3g} over max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doc_attention_on_cuda_matches_the_masked_sdpa(dtype):
    _needs_cuda()
    docs = _docs()
    q, k, v = _qkv(dtype)
    out, _ = doc_attention(None, q, k, v, None, doc_spans=doc_spans(docs))
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=doc_causal_mask(docs))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_path_on_cuda_matches_the_masked_sdpa_and_the_spans(dtype):
    _needs_cuda()
    docs = _docs()
    q, k, v = _qkv(dtype)
    w = torch.randn(2, 1024, 8, 64, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    kwargs = doc_attention_kwargs(docs)  # auto on CUDA: flex
    assert set(kwargs) == {"doc_blocks"}
    out, _ = doc_attention(None, q, k, v, None, scaling=0.1, **kwargs)
    spans, _ = doc_attention(None, q, k, v, None, scaling=0.1, doc_spans=doc_spans(docs))
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=doc_causal_mask(docs), scale=0.1)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=tol, atol=tol)
    torch.testing.assert_close(out, spans, rtol=tol, atol=tol)
    grads = torch.autograd.grad((out.float() * w.float()).sum(), (q, k, v))
    span_grads = torch.autograd.grad((spans.float() * w.float()).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, span_grads):
        assert torch.isfinite(a).all(), name
        _assert_near(a, b, 3e-2 if dtype == torch.bfloat16 else 1e-3, f"grad {name}")
    # Negative control: the block mask of another layout gives other outputs.
    other = doc_block_mask(torch.stack([doc_ids((500, 500), 1024), doc_ids((24, 1000), 1024)]).cuda())
    wrong, _ = doc_attention(None, q, k, v, None, scaling=0.1, doc_blocks=other)
    assert (wrong.float() - out.float()).abs().max() > 1e-1


def test_an_llm_block_computes_the_same_through_flex_and_through_spans():
    _needs_cuda()
    from disttrain_ds.families.llama.model import LlmBlock

    cfg = LLMConfig(hidden_size=512, heads=8, kv_heads=2, ffn_hidden=1024, layers=1, vocab_size=32)
    torch.manual_seed(0)
    blocks = {how: LlmBlock(dataclasses.replace(cfg, doc_attention=how), 0).cuda() for how in ("spans", "flex")}
    blocks["flex"].load_state_dict(blocks["spans"].state_dict())
    docs = _docs(1000)  # not a multiple of flex's 128-token blocks
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(2, 1000, 512, generator=g).cuda() for _ in range(2))
    outs, grads = {}, {}
    for how, block in blocks.items():
        h = x.clone().requires_grad_()
        out, passed = block((h, docs))
        assert passed is docs
        (out * w).sum().backward()
        outs[how] = out.detach()
        grads[how] = [h.grad] + [p.grad for p in block.parameters()]
    _assert_near(outs["flex"], outs["spans"], 1e-4, "block output")
    for i, (a, b) in enumerate(zip(grads["flex"], grads["spans"])):
        assert torch.isfinite(a).all()
        _assert_near(a, b, 1e-3, f"gradient {i}")


def test_varlen_path_on_cuda_matches_the_masked_sdpa_and_the_spans_in_bf16():
    _needs_cuda()
    docs = _docs()
    q, k, v = _qkv(torch.bfloat16)
    w = torch.randn(2, 1024, 8, 64, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    kwargs = doc_attention_kwargs(docs, "varlen")
    assert set(kwargs) == {"doc_offsets", "doc_longest"}
    out, _ = doc_attention(None, q, k, v, None, scaling=0.1, **kwargs)
    spans, _ = doc_attention(None, q, k, v, None, scaling=0.1, doc_spans=doc_spans(docs))
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=doc_causal_mask(docs), scale=0.1)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, spans, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad((out.float() * w.float()).sum(), (q, k, v))
    span_grads = torch.autograd.grad((spans.float() * w.float()).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, span_grads):
        assert torch.isfinite(a).all(), name
        _assert_near(a, b, 3e-2, f"grad {name}")
    # Negative control: the offsets of another layout give other outputs.
    other = doc_attention_kwargs(torch.stack([doc_ids((500, 500), 1024), doc_ids((24, 1000), 1024)]).cuda(), "varlen")
    wrong, _ = doc_attention(None, q, k, v, None, scaling=0.1, **other)
    assert (wrong.float() - out.float()).abs().max() > 1e-1

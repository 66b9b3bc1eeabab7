"""Per-document attention on CUDA (flash / efficient SDPA kernels) against the masked reference."""

from __future__ import annotations

import pytest
import torch

from disttrain_ds.data.types import doc_ids
from disttrain_ds.models.doc_mask import doc_attention, doc_causal_mask, doc_spans

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doc_attention_on_cuda_matches_the_masked_sdpa(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    docs = torch.stack([doc_ids((300, 100, 600), 1024), doc_ids((1000,), 1024)]).cuda()
    q = torch.randn(2, 8, 1024, 64, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 1024, 64, generator=g).to("cuda", dtype).requires_grad_() for _ in range(2))
    out, _ = doc_attention(None, q, k, v, None, doc_spans=doc_spans(docs))
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=doc_causal_mask(docs))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))

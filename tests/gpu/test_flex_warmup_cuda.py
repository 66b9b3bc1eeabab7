"""Flex attention warmed up before step 1 on CUDA: the warm-up compiles, and the LLM block's first
real forward, backward and no-grad forward after it compile nothing more."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.mllm.flex_warmup import warm_up_stage
from disttrain_ds.models import doc_mask
from disttrain_ds.samples import doc_ids

pytestmark = pytest.mark.gpu

FX_CACHE = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
"""Inductor counts one of these per graph it compiles (a backward compiled at its first use too)."""


def _compiled() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["inductor"][k] for k in FX_CACHE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_warm_up_compiles_and_the_first_real_calls_do_not_recompile(monkeypatch, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from disttrain_ds.families.llama.model import LlmBlock

    torch._dynamo.reset()
    monkeypatch.setattr(doc_mask, "_FLEX", {})  # a fresh compiled kernel for this test
    counters.clear()
    cfg = LLMConfig(hidden_size=256, heads=4, kv_heads=2, ffn_hidden=512, layers=1, vocab_size=32, doc_attention="flex")
    block = LlmBlock(cfg, 0).cuda().to(dtype)
    device = torch.device("cuda")

    assert warm_up_stage(block, batch=2, seq_len=1000, device=device) == 1
    warmed = _compiled()
    assert warmed[0] >= 1, "the warm-up compiled nothing"

    docs = torch.stack([doc_ids((300, 100, 500), 1000), doc_ids((976,), 1000)]).cuda()  # another layout
    hidden = torch.randn(2, 1000, 256, device=device, dtype=dtype, requires_grad=True)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a failed guard raises, naming it
        out, _ = block((hidden, docs))
        out.float().sum().backward()
        with torch.no_grad():
            block((hidden.detach(), docs))
    torch.cuda.synchronize()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert _compiled() == warmed, f"compiled after the warm-up: {warmed} -> {_compiled()}"

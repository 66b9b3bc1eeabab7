"""A training step's hot path on CUDA never waits for the device: an LLM stage's forward, loss,
backward and optimizer step under ``torch.cuda.set_sync_debug_mode("error")``, once the
microbatch's one host read (its attention arguments) is done; and a compiled stage likewise."""

from __future__ import annotations

import pytest
import torch

from disttrain_ds.models.compiled import compile_layers
from disttrain_ds.models.doc_mask import doc_attention_kwargs
from disttrain_ds.models.layers import Sequential
from disttrain_ds.models.objectives import lm_loss_sum
from disttrain_ds.models.packed import host_sizes
from disttrain_ds.models.pixels import pack_images
from disttrain_ds.samples import IGNORE_INDEX, doc_ids

pytestmark = pytest.mark.gpu


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _step(tiny_spec, docs: list[tuple[int, ...]], choice: str, compiled: bool,
          dtype: torch.dtype = torch.float32) -> None:
    spec = tiny_spec.with_changes("llm", doc_attention=choice)
    with torch.device("cuda"):
        llm = Sequential([d.build() for d in spec.layers("llm")]).to(dtype)
    if compiled:
        compile_layers(llm.layers)
    opt = torch.optim.AdamW(llm.parameters(), lr=1e-4, fused=True)
    s = 128
    ids = torch.randint(0, 200, (len(docs), s), device="cuda")
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    doc = torch.stack([doc_ids(row, s) for row in docs]).cuda()
    rows = torch.zeros(0, spec.llm.hidden_size, device="cuda", dtype=dtype)
    for first in (True, False):  # the first step compiles (host work); the second is the one checked
        doc_attention_kwargs(doc, choice)  # the microbatch's one host read, made as it arrives
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn" if first else "error")
        try:
            logits, _ = llm((ids, rows, doc))
            lm_loss_sum(logits, labels, 0.5).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        doc = doc.clone()  # the next microbatch: a new tensor, whose arguments are read anew


@pytest.mark.parametrize("choice, docs, dtype", [("spans", [(50, 78), (128,)], torch.float32),
                                                 ("auto", [(128,), (128,)], torch.float32),
                                                 ("varlen", [(50, 78), (128,)], torch.bfloat16)])
@pytest.mark.parametrize("compiled", [False, True])
def test_an_llm_step_reads_nothing_back_from_the_device(tiny_spec, choice, docs, dtype, compiled):
    _needs_cuda()
    _step(tiny_spec, docs, choice, compiled, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["flex", "varlen"])
def test_an_encoder_step_on_mixed_image_sizes_reads_nothing_back_after_its_sizes(tiny_spec, dtype):
    # Images of three sizes: the blocks attend them in one call (flex in float32, varlen flash in
    # bfloat16); the embedding reads the sizes once per microbatch, before the checked region.
    _needs_cuda()
    with torch.device("cuda"):
        embed, *rest = [d.build().to(dtype) for d in tiny_spec.layers("encoder")]
    flat, hw = pack_images([torch.randn(3, s, s) for s in (16, 24, 32, 16)])
    for first in (True, False):  # the first step compiles flex (host work); the second is checked
        hidden, counts = embed((flat.to("cuda", dtype), hw.cuda()))
        host_sizes(counts)  # the microbatch's one host read, made as it arrives
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn" if first else "error")
        try:
            out = (hidden, counts)
            for layer in rest:
                out = layer(out)
            out.float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_the_check_catches_a_host_read():
    # Negative control: the debug mode does raise on a read inside the checked region.
    _needs_cuda()
    x = torch.ones(3, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")

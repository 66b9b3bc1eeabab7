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
from disttrain_ds.samples import IGNORE_INDEX, doc_ids

pytestmark = pytest.mark.gpu


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _step(tiny_spec, docs: list[tuple[int, ...]], choice: str, compiled: bool) -> None:
    spec = tiny_spec.with_changes("llm", doc_attention=choice)
    with torch.device("cuda"):
        llm = Sequential([d.build() for d in spec.layers("llm")])
    if compiled:
        compile_layers(llm.layers)
    opt = torch.optim.AdamW(llm.parameters(), lr=1e-4, fused=True)
    s = 128
    ids = torch.randint(0, 200, (len(docs), s), device="cuda")
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    doc = torch.stack([doc_ids(row, s) for row in docs]).cuda()
    rows = torch.zeros(0, spec.llm.hidden_size, device="cuda")
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


@pytest.mark.parametrize("choice, docs", [("spans", [(50, 78), (128,)]), ("auto", [(128,), (128,)])])
@pytest.mark.parametrize("compiled", [False, True])
def test_an_llm_step_reads_nothing_back_from_the_device(tiny_spec, choice, docs, compiled):
    _needs_cuda()
    _step(tiny_spec, docs, choice, compiled)


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

"""Cases shared by the CPU (gloo) and CUDA (NCCL) tests of tensor parallelism on sequence slices:
a two-block LLM run whole and sharded over a TP group of two, compared layer by layer."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.families.llama.model import LLAMA, decoder_layers
from disttrain_ds.families.qwen2.model import QWEN2
from disttrain_ds.models.compiled import compile_layers
from disttrain_ds.parallel.tensor_parallel import TPContext, shard_layer, shard_rows
from disttrain_ds.parallel.tp_sequence import TPSeqContext, attach

WORLD = 2
B, S, VOCAB = 2, 12, 48  # two rows, each of several documents; S / 2 = 6 positions per slice
CASES = {
    # name: (family, config overrides, chunks)
    "llama_chunks1": ("llama", {}, 1),
    "llama_chunks3": ("llama", {}, 3),
    "llama_biases_tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_embeddings": True}, 2),
    "qwen2_chunks2": ("qwen2", {}, 2),
}


def config(family: str, overrides: dict) -> LLMConfig:
    """The cases' two-block LLM."""
    return LLMConfig(family=family, hidden_size=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48, vocab_size=VOCAB,
                     **overrides)


def layer_defs(family: str, overrides: dict):
    """The cases' LLM as pipeline layer definitions (embedding, two blocks, head)."""
    ctx = BuildContext(module="llm", seed=3, llm_hidden=32, image_token=VOCAB - 1)
    return decoder_layers(config(family, overrides), ctx, QWEN2 if family == "qwen2" else LLAMA)


def _run(layers: list[torch.nn.Module], ids: torch.Tensor, doc_ids: torch.Tensor, weights) -> torch.Tensor:
    x = (ids, torch.zeros(0, 32, device=ids.device), doc_ids)
    for layer in layers:
        x = layer(x)
    logits, normed = x
    return (logits * weights[0]).sum() + (normed * weights[1]).sum()


def _expected_grad(ref: torch.Tensor, p: torch.nn.Parameter, rank: int) -> torch.Tensor:
    if not hasattr(p, "tp_dim"):
        return ref
    if p.tp_dim == 0:
        return shard_rows(ref, rank, WORLD, p.tp_pieces)
    return ref.chunk(WORLD, dim=1)[rank]


def worst_grad_error(ref: list[torch.nn.Module], sharded: list[torch.nn.Module], defs, rank: int) -> tuple[float, str]:
    """The worst gradient error of ``sharded`` against ``ref`` (this rank's shard of each gradient),
    relative to the layer's largest gradient: a key bias's gradient is zero up to rounding (softmax
    ignores a shift shared by every key), so its own scale is noise; and where it is."""
    worst, where = 0.0, ""
    for r_layer, s_layer, d in zip(ref, sharded, defs):
        ref_grads = dict(r_layer.named_parameters())
        scale = max((float(p.grad.abs().max()) for p in ref_grads.values() if p.grad is not None), default=0.0)
        for name, p in s_layer.named_parameters():
            if ref_grads[name].grad is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            err = float((p.grad - _expected_grad(ref_grads[name].grad, p, rank)).abs().max()) / max(scale, 1e-12)
            if err > worst:
                worst, where = err, f"{d.name}.{name}"
    return worst, where


def sharded_layers(defs, group, rank: int, chunks: int, hooks: bool, device: str) -> list[torch.nn.Module]:
    """``defs`` built, TP-sharded over ``group`` and on sequence slices in ``chunks`` pieces; without
    ``hooks`` the replicated parameters' gradients are left unsummed over TP (the fault to catch)."""
    tp = TPContext(group, rank, WORLD, 0)
    ctx = TPSeqContext(tp, chunks)
    sharded = []
    for d in defs:
        layer = shard_layer(d.build(), tp).to(device)
        if not hooks:
            for m in layer.modules():  # the layer itself, or blocks inside it (a U-Net's transformer blocks)
                if getattr(m, "tp_seq_region", False):
                    m.tp_seq_region = False
        sharded.append(attach(layer, ctx))
    return sharded


def case(rank: int, group, family: str, overrides: dict, chunks: int, hooks: bool, device: str = "cpu",
         backend: str | None = None) -> dict:
    """One rank's run of a case: losses, and the worst gradient error against the unsharded layers;
    ``backend``: the sharded layers compiled with it (``compile_layers``), counting the graphs of a
    decoder block in ``graphs``."""
    defs = layer_defs(family, overrides)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB - 1, (B, S), generator=g)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5])
    weights = (torch.randn(B, S, VOCAB, generator=g).to(device), torch.randn(B, S, 32, generator=g).to(device))
    ids, doc_ids = ids.to(device), doc_ids.to(device)

    ref = [d.build().to(device) for d in defs]
    ref_loss = _run(ref, ids, doc_ids, weights)
    ref_loss.backward()

    sharded = sharded_layers(defs, group, rank, chunks, hooks, device)
    counters = []
    if backend is not None:
        torch._dynamo.reset()
        for layer in sharded:
            counters.append(CompileCounterWithBackend(backend))
            compile_layers([layer], backend=counters[-1])
    sliced = sharded[0]((ids, torch.zeros(0, 32, device=device), doc_ids))[0].shape  # between blocks: this rank's slice
    loss = _run(sharded, ids, doc_ids, weights)
    loss.backward()

    worst, where = 0.0, ""
    for r_layer, s_layer, d in zip(ref, sharded, defs):
        ref_grads = dict(r_layer.named_parameters())
        for name, p in s_layer.named_parameters():
            want = _expected_grad(ref_grads[name].grad, p, rank)
            err = float((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-12))
            if err > worst:
                worst, where = err, f"{d.name}.{name}"
    graphs = {type(layer).__name__: c.frame_count for layer, c in zip(sharded, counters)}
    return {"loss": float(loss), "ref_loss": float(ref_loss), "grad_err": worst, "where": where, "sliced": tuple(sliced),
            "graphs": graphs}

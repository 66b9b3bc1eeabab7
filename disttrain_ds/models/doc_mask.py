"""Document masking of packed sequences: attention and rotary positions per document.

A packed sequence holds several documents one after the other, then padding. Each position
carries its document index (``PackedSample.doc_ids``: 0, 1, ... and ``NO_DOC`` on the padding).
A query attends to the keys of its own document up to itself, and positions count from 0 at the
start of each document, so a document's outputs are those it would have alone. The padding forms
one more span that attends only to itself; nothing attends to it.

The LLM runs this as ``doc_attention``, in one of two ways that compute the same function, chosen
by ``LLMConfig.doc_attention`` (``doc_attention_kwargs``):

- spans: causal SDPA on each span, spans of equal length batched (``models/packed.py``), so no
  [S, S] mask is built or kept and the attention work is the cost model's sum of squared document
  lengths; the default off CUDA (flex attention has no backward on CPU);
- flex: compiled flex attention under a block mask built from the spans' block ends
  (``doc_block_mask``, no [S, S] mask either); the default on CUDA, where it is the faster one;
- varlen: flash attention over variable lengths (``torch.nn.attention.varlen``), causal within each
  span, from the spans' offsets; CUDA in half precision, asked for by name.

A microbatch whose rows each hold one whole document takes neither: plain causal SDPA over the
rows (``doc_whole``), unless flex is asked for by name. Either is built once per microbatch, with
the one read from the device it needs, and reused by every block of a stage; the attention call
itself reads nothing back from the device. ``doc_causal_mask`` is
the same rule as a boolean mask (tests and ``bench/bench_doc_mask.py`` compare them).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.nn.attention.varlen import varlen_attn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.packed import per_item

DOC_ATTENTION = "disttrain_doc_spans"
"""Name of ``doc_attention`` among transformers' attention implementations."""


FLEX_BLOCK = 128
"""Side of flex attention's mask blocks (its default sparse block size)."""

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes flash attention over variable lengths computes in."""


def _run_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: True where a run of one document (or of padding) begins."""
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return start


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each position's offset from the start of its document (or of the padding)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    first = torch.where(_run_starts(doc_ids), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def doc_runs(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: the index of each position's run (0, 1, ... along each row, padding included):
    the spans of ``doc_spans`` numbered, ascending along a row."""
    return _run_starts(doc_ids).long().cumsum(dim=1) - 1


def doc_spans(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [spans]: lengths of the runs of one document (or of padding), row after row."""
    b, s = doc_ids.shape
    # Offsetting each row keeps the last run of a row apart from the first run of the next.
    keyed = doc_ids + (s + 2) * torch.arange(b, device=doc_ids.device).unsqueeze(1)
    return torch.unique_consecutive(keyed.flatten(), return_counts=True)[1]


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, S, S]: True where query i may attend key j (same document, j <= i)."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal).unsqueeze(1)


def doc_mask_mod(runs: torch.Tensor, causal: bool = True) -> Callable:
    """flex attention's mask_mod over ``doc_runs``: query q may attend key kv of its own run, kv <= q
    (``causal``; else any key of its run: an encoder's packed items)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (runs[b, q_idx] == runs[b, kv_idx]) & (q_idx >= kv_idx)

    def same_run(b, h, q_idx, kv_idx):
        return runs[b, q_idx] == runs[b, kv_idx]

    return mask_mod if causal else same_run


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [B, 1, nq, nk] block flags -> (blocks per query block, their kv block indices first),
    as flex attention's own ``create_block_mask`` orders them."""
    dense = dense.to(torch.int32)
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def doc_block_mask(doc_ids: torch.Tensor, block: int = FLEX_BLOCK, causal: bool = True) -> BlockMask:
    """flex attention's block mask of ``doc_mask_mod`` for [B, S] ``doc_ids``, built from each
    block's first and last run (B x blocks^2 work, no [S, S] mask as ``create_block_mask`` makes)."""
    b, s = doc_ids.shape
    runs = doc_runs(doc_ids)
    n = -(-s // block)
    # Positions past S form a run of their own (run indices stay below S), so no last block is full.
    ends = F.pad(runs, (0, n * block - s), value=s).view(b, n, block)
    # [B, q block i, kv block j]; runs ascend along a row, so each block spans the runs first..last.
    first_q, last_q = ends[..., 0, None], ends[..., -1, None]
    first_kv, last_kv = ends[:, None, :, 0], ends[:, None, :, -1]
    # Every pair is allowed iff one run covers both blocks.
    full = (first_kv == last_q) & (first_q == last_kv)
    some = (first_kv <= last_q) & (first_q <= last_kv)  # they share a run
    if causal:  # and only kv blocks up to the q block: before it (full or partial), or itself (partial)
        i = torch.arange(n, device=doc_ids.device)
        below = i[:, None] > i[None, :]
        full, some = full & below, (some & below) | (i[:, None] == i[None, :])
    partial = some & ~full
    kv_num, kv_idx = _ordered(partial.unsqueeze(1))
    full_num, full_idx = _ordered(full.unsqueeze(1))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=doc_mask_mod(runs, causal), seq_lengths=(s, s))


_FLEX: dict[bool, Callable] = {}


def flex_kernel(dynamic: bool = False) -> Callable:
    """``flex_attention`` compiled once for the process (uncompiled it materialises the scores);
    ``dynamic``: for lengths that change every microbatch (an encoder's packed items), one graph
    for all of them instead of one per length."""
    if dynamic not in _FLEX:
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def doc_attention_path(choice: str, device: torch.device) -> str:
    """``LLMConfig.doc_attention`` on ``device`` -> "spans", "flex" or "varlen"."""
    if choice == "auto":
        return "flex" if device.type == "cuda" else "spans"
    if choice in ("flex", "varlen") and device.type != "cuda":
        raise ConfigError(f"doc_attention: {choice} needs a CUDA device (its kernel has no backward on "
                          f"{device.type}); set model.<llm>.doc_attention to auto or spans")
    if choice not in ("spans", "flex", "varlen"):
        raise ConfigError(f"doc_attention must be one of auto | spans | flex | varlen, got {choice!r}")
    return choice


_LAST: tuple = ()
"""(doc_ids tensor, its version, choice, kwargs) of the last microbatch seen."""


@torch.compiler.disable
def doc_attention_kwargs(doc_ids: torch.Tensor, choice: str = "auto") -> dict:
    """Keyword arguments for ``doc_attention`` for [B, S] ``doc_ids``, built once per microbatch
    (every block of a stage passes the same tensor on): ``doc_whole`` where every row holds one
    whole document, so plain causal SDPA is the rule (unless ``flex`` is asked for); else
    ``doc_blocks`` on the flex path, or ``doc_spans`` (the span lengths, read to the host here
    once, so no block waits for the device to read them)."""
    global _LAST
    if _LAST and _LAST[0] is doc_ids and _LAST[1] == doc_ids._version and _LAST[2] == choice:
        return _LAST[3]
    path = doc_attention_path(choice, doc_ids.device)
    spans = doc_spans(doc_ids).cpu()
    b, s = doc_ids.shape
    # One whole document per row: plain causal SDPA per row (cuDNN on CUDA) beat flex on one 8K
    # document on an H200 (199.5 vs 213.9 ms per 1.1B LLM step).
    whole = spans.numel() == b and bool((spans == s).all())  # (a row of padding attends to itself either way)
    if whole and choice != "flex":
        kwargs = {"doc_whole": True}
    elif path == "flex":
        kwargs = {"doc_blocks": doc_block_mask(doc_ids)}
    elif path == "varlen":  # offsets from the host spans, copied without waiting on the device
        offsets = span_offsets(spans).to(doc_ids.device, non_blocking=True)
        kwargs = {"doc_offsets": offsets, "doc_longest": int(spans.max())}
    else:
        kwargs = {"doc_spans": spans}
    _LAST = (doc_ids, doc_ids._version, choice, kwargs)
    return kwargs


def doc_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  doc_spans=None, doc_blocks: BlockMask | None = None, doc_whole: bool = False,
                  seq_parallel=None, doc_offsets: torch.Tensor | None = None, doc_longest: int = 0, **kwargs):
    """transformers attention interface: q [B, Hq, S, D], k / v [B, Hkv, S, D] -> [B, S, Hq, D],
    causal inside each span of ``doc_spans`` (lengths covering the B rows in order: a tensor, on
    the host to avoid a device read per call), under the block mask ``doc_blocks``
    (``doc_block_mask``) through compiled flex attention, inside each span of ``doc_offsets`` (int32
    [spans + 1], where each span of the B x S positions starts; ``doc_longest`` the longest) through
    flash attention over variable lengths, or, with ``doc_whole``, causal over each whole row (one
    document per row). Exactly one of the four.

    ``seq_parallel`` (an ``SPContext``): q, k, v hold this rank's slice of every row; they are
    exchanged for whole rows of 1/SP of the heads, attended, and exchanged back (Ulysses), while
    the document arguments describe the whole rows. With fewer KV heads than SP ranks each KV head
    is repeated for the ranks whose query heads read it (as DeepSpeed-Ulysses does)."""
    given = (doc_spans is not None) + (doc_blocks is not None) + bool(doc_whole) + (doc_offsets is not None)
    if attention_mask is not None or given != 1:
        raise ValueError(f"{DOC_ATTENTION} attention takes one of doc_spans, doc_blocks, doc_offsets, doc_whole "
                         "and no attention_mask")
    docs = {"doc_spans": doc_spans, "doc_blocks": doc_blocks, "doc_whole": doc_whole, "doc_offsets": doc_offsets,
            "doc_longest": doc_longest}
    if seq_parallel is not None:
        return _sp_attention(module, query, key, value, dropout, scaling, docs, seq_parallel), None
    hk, hq = key.shape[1], query.shape[1]
    if doc_whole:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
                                             enable_gqa=hk != hq)
        return out.transpose(1, 2), None
    if doc_blocks is not None:
        if dropout:
            raise ValueError(f"{DOC_ATTENTION} attention through flex has no dropout, got {dropout}")
        out = flex_kernel()(query, key, value, block_mask=doc_blocks, scale=scaling, enable_gqa=hk != hq)
        return out.transpose(1, 2), None
    if doc_offsets is not None:
        if dropout:
            raise ValueError(f"{DOC_ATTENTION} attention through varlen has no dropout, got {dropout}")
        return _varlen_attention(query, key, value, doc_offsets, doc_longest, scaling), None
    return _span_attention(query, key, value, doc_spans, dropout, scaling), None


def span_offsets(spans: torch.Tensor) -> torch.Tensor:
    """int32 [spans + 1]: where each span of ``spans`` (lengths) starts, then the total (flash's
    cumulative sequence lengths)."""
    return F.pad(spans.cumsum(0), (1, 0)).to(torch.int32)


def flash_spans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, longest: int,
                scale: float | None, causal: bool) -> torch.Tensor:
    """Rows q [T, Hq, D], k / v [T, Hkv, D] attending within each span of ``offsets``
    (``span_offsets``; ``longest`` the longest span), ``causal`` or not, in one call of flash
    attention over variable lengths -> [T, Hq, D]."""
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scale,
                       window_size=(-1, 0) if causal else (-1, -1), enable_gqa=k.shape[1] != q.shape[1])


def _varlen_attention(query, key, value, offsets, longest: int, scaling) -> torch.Tensor:
    """Causal attention inside each span of ``offsets`` over the B x S positions as one sequence:
    q [B, Hq, S, D], k / v [B, Hkv, S, D] (views of [B, S, H, D] projections) -> [B, S, Hq, D]."""
    b, hq, s, d = query.shape
    if query.dtype not in FLASH_DTYPES:
        raise ConfigError(f"doc_attention: varlen computes in half precision, got {query.dtype}; "
                          "set train.dtype to bf16 or model.<llm>.doc_attention to auto, spans or flex")
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))  # views
    return flash_spans(q, k, v, offsets, longest, scaling, causal=True).view(b, s, hq, d)


@torch.compiler.disable
def _sp_attention(module, query, key, value, dropout, scaling, docs: dict, seq_parallel):
    """``doc_attention`` on a sequence-parallel slice (its docstring); left out of compiled graphs:
    the all-to-alls run through the process group, not as traced collectives."""
    if key.shape[1] < seq_parallel.size:  # fewer KV heads than SP ranks: each rank gets a copy of its group's
        reps = seq_parallel.size // key.shape[1]
        key, value = key.repeat_interleave(reps, dim=1), value.repeat_interleave(reps, dim=1)
    query, key, value = seq_parallel.heads_to_seq(query, key, value)
    out, _ = doc_attention(module, query, key, value, None, dropout, scaling, **docs)
    return seq_parallel.seq_to_heads(out)


@torch.compiler.disable
def _span_attention(query, key, value, doc_spans, dropout, scaling) -> torch.Tensor:
    """Causal SDPA on each span, spans of equal length batched; left out of compiled graphs (its
    loops follow the span lengths, which change every microbatch)."""
    b, hq, s, d = query.shape
    hk = key.shape[1]
    # One row per position holding its q, k and v, so spans cut all three at once.
    rows = torch.cat([t.transpose(1, 2).reshape(b * s, -1) for t in (query, key, value)], dim=-1)

    def attend(x: torch.Tensor) -> torch.Tensor:  # [spans, length, (Hq + 2 Hkv) D]
        n, length, _ = x.shape
        q, k, v = (t.reshape(n, length, -1, d).transpose(1, 2) for t in x.split([hq * d, hk * d, hk * d], dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                           enable_gqa=hk != hq)
        return o.transpose(1, 2).reshape(n, length, hq * d)

    return per_item(attend, rows, doc_spans).reshape(b, s, hq, d)


ALL_ATTENTION_FUNCTIONS.register(DOC_ATTENTION, doc_attention)

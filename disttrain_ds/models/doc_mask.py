"""Document masking of packed sequences: attention and rotary positions per document.

A packed sequence holds several documents one after the other, then padding. Each position
carries its document index (``PackedSample.doc_ids``: 0, 1, ... and ``NO_DOC`` on the padding).
A query attends to the keys of its own document up to itself, and positions count from 0 at the
start of each document, so a document's outputs are those it would have alone. The padding forms
one more span that attends only to itself; nothing attends to it.

The LLM runs this as ``doc_attention``: causal SDPA on each span, spans of equal length batched
(``models/packed.py``), so no [S, S] mask is built or kept and the attention work is the cost
model's sum of squared document lengths. ``doc_causal_mask`` is the same rule as a boolean mask
(tests and ``bench/bench_doc_mask.py`` compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .packed import per_item

DOC_ATTENTION = "disttrain_doc_spans"
"""Name of ``doc_attention`` among transformers' attention implementations."""


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each position's offset from the start of its document (or of the padding)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


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


def doc_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  doc_spans=None, **kwargs):
    """transformers attention interface: q [B, Hq, S, D], k / v [B, Hkv, S, D] -> [B, S, Hq, D],
    causal inside each span of ``doc_spans`` (lengths covering the B rows in order)."""
    if doc_spans is None or attention_mask is not None:
        raise ValueError(f"{DOC_ATTENTION} attention takes doc_spans and no attention_mask")
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

    return per_item(attend, rows, doc_spans).reshape(b, s, hq, d), None


ALL_ATTENTION_FUNCTIONS.register(DOC_ATTENTION, doc_attention)

"""Document masking of packed sequences: attention and rotary positions per document.

A packed sequence holds several documents one after the other, then padding. Each position
carries its document index (``PackedSample.doc_ids``: 0, 1, ... and ``NO_DOC`` on the padding).
A query attends to the keys of its own document up to itself, and positions count from 0 at the
start of each document, so a document's outputs are those it would have alone. Padding attends
only to padding (a row with no allowed key would make the softmax NaN) and nothing attends to it.
"""

from __future__ import annotations

import torch


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each position's offset from the start of its document (or of the padding)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, S, S]: True where query i may attend key j (same document, j <= i)."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal).unsqueeze(1)

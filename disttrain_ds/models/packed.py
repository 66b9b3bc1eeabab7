"""Items of different lengths (images' patches, audio clips' frames) travel as rows packed along
dim 0 plus a count per item; attention must stay within an item, so layers run the items of
equal length together as one batch: no padding, no mask, exact."""

from __future__ import annotations

from typing import Callable

import torch


def by_length(sizes: list[int]) -> dict[int, list[int]]:
    """Item indices grouped by length, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        groups.setdefault(n, []).append(i)
    return groups


def per_item(fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``fn`` on [items of one length, length, width] batches, rows packed back in item order."""
    sizes = counts.tolist()
    pieces = list(torch.split(hidden, sizes))
    out: list[torch.Tensor | None] = [None] * len(pieces)
    for idx in by_length(sizes).values():
        res = fn(torch.stack([pieces[i] for i in idx]))
        for j, i in enumerate(idx):
            out[i] = res[j]
    return torch.cat(out) if out else hidden

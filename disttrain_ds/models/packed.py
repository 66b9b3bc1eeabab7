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


def pack_clips(clips: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten log-mel clips [n_mels, frames] into one 1-D tensor plus an int64 [n, 2] (n_mels, frames) table."""
    if not clips:
        return torch.zeros(0), torch.zeros(0, 2, dtype=torch.long)
    flat = torch.cat([c.reshape(-1) for c in clips])
    shapes = torch.tensor([[c.shape[0], c.shape[1]] for c in clips], dtype=torch.long)
    return flat, shapes


def unpack_clips(flat: torch.Tensor, shapes: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of ``pack_clips``: views [n_mels, frames] into ``flat``."""
    out, offset = [], 0
    for mels, frames in shapes.tolist():
        n = mels * frames
        out.append(flat[offset : offset + n].view(mels, frames))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"audio features hold {flat.numel()} values but their shapes describe {offset}")
    return out

"""Items of different lengths (images' patches, audio clips' frames) travel as rows packed along
dim 0 plus a count per item; attention must stay within an item, so layers run the items of
equal length together as one batch: no padding, no mask, exact."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Callable

import torch


def by_length(sizes: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Item indices grouped by length (any hashable size: an int, an (H, W)), in first-seen order."""
    groups: dict[Hashable, list[int]] = {}
    for i, n in enumerate(sizes):
        groups.setdefault(n, []).append(i)
    return groups


_HOST: tuple = ()
"""(tensor, its version, its values as a host list) of the last item counts read."""


def host_sizes(counts: torch.Tensor) -> list[int]:
    """``counts`` as a host list, read from the device once per microbatch: every block of a stage
    passes the same counts tensor on, so the blocks after the first reuse the first one's read (a
    device-to-host copy waits for the device)."""
    global _HOST
    if _HOST and _HOST[0] is counts and _HOST[1] == counts._version:
        return _HOST[2]
    sizes = counts.tolist()
    _HOST = (counts, counts._version, sizes)
    return sizes


def per_item(fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
             counts: torch.Tensor | list[int]) -> torch.Tensor:
    """``fn`` on [items of one length, length, width] batches, rows packed back in item order;
    ``counts``: rows per item (a tensor, read once per microbatch by ``host_sizes``, or a host
    list). Items all of one length are a view of ``hidden``: no copy either way."""
    sizes = host_sizes(counts) if isinstance(counts, torch.Tensor) else list(counts)
    if sizes and len(set(sizes)) == 1 and sizes[0] * len(sizes) == hidden.shape[0]:
        out = fn(hidden.view(len(sizes), sizes[0], *hidden.shape[1:]))
        return out.reshape(hidden.shape[0], *out.shape[2:])
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

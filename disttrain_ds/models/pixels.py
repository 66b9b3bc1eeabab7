"""Images of any resolution travel as one flat tensor plus their (H, W): the image encoders' input."""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain_ds.models.packed import by_length


def pack_images(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten images [3, H, W] into one 1-D tensor plus an int64 [n, 2] (H, W) table."""
    if not images:
        return torch.zeros(0), torch.zeros(0, 2, dtype=torch.long)
    flat = torch.cat([im.reshape(-1) for im in images])
    hw = torch.tensor([[im.shape[1], im.shape[2]] for im in images], dtype=torch.long)
    return flat, hw


def unpack_images(flat: torch.Tensor, hw: torch.Tensor, channels: int = 3) -> list[torch.Tensor]:
    out, offset = [], 0
    for h, w in hw.tolist():
        n = channels * h * w
        out.append(flat[offset : offset + n].view(channels, h, w))
        offset += n
    return out


def embed_by_size(embed: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor, hw: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``embed`` ([n, 3, H, W] -> [n, rows, width]) on the images of ``flat`` / ``hw``, all images
    of one size in one call (a view of ``flat`` when they all share it: no copy), rows packed in
    image order; returns (rows [sum, width], rows per image int64 on rows' device). ``hw`` is read
    to the host once here."""
    sizes = [tuple(x) for x in hw.tolist()]
    if not sizes:
        return flat.new_zeros(0, width), torch.zeros(0, dtype=torch.long, device=flat.device)
    if len(set(sizes)) == 1:
        (h, w), n = sizes[0], len(sizes)
        out = embed(flat.view(n, -1, h, w))
        return out.reshape(-1, out.shape[-1]), torch.full((n,), out.shape[1], dtype=torch.long, device=out.device)
    images = unpack_images(flat, hw)
    rows: list[torch.Tensor | None] = [None] * len(images)
    for idx in by_length(sizes).values():
        out = embed(torch.stack([images[i] for i in idx]))
        for j, i in enumerate(idx):
            rows[i] = out[j]
    counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=rows[0].device)
    return torch.cat(rows), counts

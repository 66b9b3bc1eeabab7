"""Images of any resolution travel as one flat tensor plus their (H, W): the image encoders' input."""

from __future__ import annotations

import torch


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

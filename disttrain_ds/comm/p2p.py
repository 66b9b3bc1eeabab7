"""Asynchronous point-to-point messages with a shape handshake and a deadline.

Each message is two transfers: a fixed-size int64 header (dtype, rank, shape) and the payload,
so receivers need not know shapes in advance (images per sample vary). On CUDA, transfers are
issued on a dedicated side stream ordered against the compute stream with stream waits, so they
overlap compute; on CPU (gloo) the same code runs without streams. Waits poll with a deadline and
raise ``CommTimeoutError`` naming both ends instead of hanging forever.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER = 10  # dtype id, ndim, up to 8 dims
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


class CommTimeoutError(RuntimeError):
    """A peer did not send or receive in time (stuck or dead)."""


def shape_header(t: torch.Tensor) -> torch.Tensor:
    """``t``'s dtype and shape as the fixed-size int64 header sent ahead of its payload."""
    if t.dim() > HEADER - 2:
        raise ValueError(f"tensor of {t.dim()} dims exceeds the header's {HEADER - 2}")
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0], h[1] = DTYPES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def empty_like_header(h: torch.Tensor, device) -> torch.Tensor:
    """An uninitialised tensor of the dtype and shape ``h`` describes, to receive the payload into."""
    ndim = int(h[1])
    shape = [int(x) for x in h[2 : 2 + ndim]]
    return torch.empty(shape, dtype=DTYPES[int(h[0])], device=device)


@dataclass
class PeerInfo:
    """How to name a rank in error messages."""

    names: dict[int, str] = field(default_factory=dict)
    """Global rank -> 'llm stage 0 dp 1' style description."""

    def __call__(self, rank: int) -> str:
        return f"rank {rank} ({self.names.get(rank, '?')})"


class P2P:
    """Tagged async send/recv on one process group, with side stream and timeouts."""

    def __init__(self, group, rank: int, device: torch.device, timeout_s: float, peers: PeerInfo):
        self.group, self.rank, self.device, self.timeout_s, self.peers = group, rank, device, timeout_s, peers
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._sends: list[tuple[object, torch.Tensor, str]] = []

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        """Start sending ``tensor`` (header then payload); completion is checked later."""
        tensor = tensor.detach().contiguous()
        header = shape_header(tensor).to(self.device)
        if self.stream is not None:
            # The payload was produced on the compute stream: order the side stream after it.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        # An empty tensor (no image in these samples) travels as its header alone.
        parts = ((header, 2 * tag), (tensor, 2 * tag + 1)) if tensor.numel() else ((header, 2 * tag),)
        with self._on_side():
            for t, tg in parts:
                work = dist.isend(t, dst, group=self.group, tag=tg)
                self._sends.append((work, t, f"{what} to {self.peers(dst)}"))

    def irecv(self, src: int, tag: int, what: str) -> "PendingRecv":
        """Post the header receive now; the payload receive is posted once the header is in."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        with self._on_side():
            work = dist.irecv(header, src, group=self.group, tag=2 * tag)
        return PendingRecv(self, src, tag, header, work, f"{what} from {self.peers(src)}")

    def _timeout(self, what: str) -> CommTimeoutError:
        return CommTimeoutError(
            f"{self.peers(self.rank)} waited {self.timeout_s:.0f} s for {what}; "
            "that peer is stuck or dead (parallel.comm_timeout_s sets the limit)"
        )

    def wait(self, work, what: str) -> None:
        if self.stream is None:
            # gloo: completion is only observed inside wait(), which takes a deadline.
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                if "imed out" in str(exc) or "imeout" in str(exc):
                    raise self._timeout(what) from None
                raise
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise self._timeout(what)
            time.sleep(0.0002)
        work.wait()

    def flush_sends(self) -> None:
        """Wait for every outstanding send (called once per step, and before exit)."""
        for work, _, what in self._sends:
            self.wait(work, what)
        self._sends.clear()



class PendingRecv:
    """A message being received: ``result()`` waits (with deadline) and returns the tensor."""

    def __init__(self, p2p: P2P, src: int, tag: int, header: torch.Tensor, work, what: str):
        self.p2p, self.src, self.tag, self.header, self.work, self.what = p2p, src, tag, header, work, what
        self._payload = None
        self._payload_work = None

    def _post_payload(self) -> None:
        self.p2p.wait(self.work, "the shape header of " + self.what)
        self._payload = empty_like_header(self.header.cpu(), self.p2p.device)
        if self._payload.numel() == 0:
            return
        with self.p2p._on_side():
            self._payload_work = dist.irecv(self._payload, self.src, group=self.p2p.group, tag=2 * self.tag + 1)

    def result(self) -> torch.Tensor:
        if self._payload is None:
            self._post_payload()
        if self._payload_work is None:  # empty: nothing beyond the header
            return self._payload
        self.p2p.wait(self._payload_work, self.what)
        if self.p2p.stream is not None:
            cur = torch.cuda.current_stream(self.p2p.device)
            cur.wait_stream(self.p2p.stream)
            self._payload.record_stream(cur)
        return self._payload

"""Asynchronous point-to-point messages between module engines, correct under NCCL's rules.

NCCL matches point-to-point messages between two ranks in posting order (no tags), runs both
directions of a pair on one stream (a pending receive blocks later ops to that peer), and a send
completes only when the peer's receive runs. So this transport:

- has one **channel per graph edge and direction**, each its own process group (hence its own NCCL
  communicator and stream): activations flow down one, gradients up the other, and a receive posted
  ahead on one can never hold up a send on another (the LLM's receive from an encoder and its send
  to a generator take different lanes);
- sends **no shape headers**: both ends compute every message's shape from the microbatch they
  both hold, so each message is one transfer and receives can be posted early, into buffers of
  the right size (an empty message is skipped by both ends);
- creates every pair's communicator up front (``connect``) in one global order, since NCCL sets
  a pair up on its first message and that blocks the posting thread until the peer joins.

On CUDA, transfers are issued from a side stream that waits on the compute stream, so they
overlap compute; the compute stream waits on a received buffer only when it uses it. Waits poll
with a deadline and raise ``CommTimeoutError`` naming both ends (NCCL work has no wait timeout).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from disttrain_ds.errors import CommTimeoutError

ACT, GRAD = "activations", "gradients"
CHANNELS = (ACT, GRAD)


_waiting: list[int | None] = [None]


def waiting_on() -> int | None:
    """The peer this process's training thread is blocked on in a transfer now, or None. The
    heartbeat carries it, so a rank whose deadline runs out can tell a peer that is stuck from one
    that itself waits for a third rank."""
    return _waiting[0]


@contextmanager
def waiting_for(peer: int | None):
    """Mark a blocking wait on ``peer`` (a global rank) for as long as it lasts."""
    before, _waiting[0] = _waiting[0], peer
    try:
        yield
    finally:
        _waiting[0] = before


@dataclass
class PeerInfo:
    """How to name a rank in error messages."""

    names: dict[int, str] = field(default_factory=dict)
    """Global rank -> 'llm stage 0 dp 1' style description."""

    def __call__(self, rank: int) -> str:
        return f"rank {rank} ({self.names.get(rank, '?')})"


def channel(kind: str, up: str, down: str) -> str:
    """The channel of one graph edge ``up -> down`` in one direction (``kind``: ACT or GRAD). Each
    is its own process group: on a device-bound world a group is one ordered lane per rank, so with
    one group per direction the LLM's receive from an encoder, posted ahead, would hold up its send
    to a generator until that encoder produced the next microbatch."""
    return f"{kind}:{up}->{down}"


def edge_channels(edges) -> list[str]:
    """Every channel of the graph ``edges`` ((upstream, downstream) names), in one order."""
    return [channel(kind, up, down) for up, down in edges for kind in CHANNELS]


def new_channel_groups(world: int, names=CHANNELS) -> dict[str, object]:
    """One process group per channel name (every rank calls this, in the same order)."""
    return {ch: dist.new_group(list(range(world))) for ch in names}


class P2P:
    """Sends and receives on the two channels of one rank, with side stream and deadlines."""

    def __init__(self, groups: dict[str, object], rank: int, device: torch.device, timeout_s: float, peers: PeerInfo):
        self.groups, self.rank, self.device, self.timeout_s, self.peers = groups, rank, device, timeout_s, peers
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._sends: list[tuple[object, torch.Tensor, str, int]] = []

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def connect(self, links: list[tuple[str, int, int]]) -> None:
        """Exchange one token on every (channel, low rank, high rank) link this rank is on, in the
        given order (the same list on every rank), each within the deadline: every pair's
        communicator then exists and has carried a message before the first step, and a global
        order of exchanges cannot deadlock."""
        for channel, lo, hi in links:
            if self.rank not in (lo, hi):
                continue
            token = torch.zeros(1, device=self.device)
            peer = hi if self.rank == lo else lo
            op = dist.isend if self.rank == lo else dist.irecv
            with self._on_side():
                work = op(token, peer, group=self.groups[channel])
            self.wait(work, f"the start-up handshake on the {channel} channel with {self.peers(peer)}", peer)

    def isend(self, tensor: torch.Tensor, dst: int, channel: str, what: str) -> None:
        """Start sending ``tensor``; completion is checked by ``flush_sends``."""
        tensor = tensor.detach().contiguous()
        if self.stream is not None:
            # The payload was produced on the compute stream: order the side stream after it.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_side():
            work = dist.isend(tensor, dst, group=self.groups[channel])
        self._sends.append((work, tensor, f"{what} to {self.peers(dst)}", dst))

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, channel: str, what: str) -> "PendingRecv":
        """Post the receive of a message of known shape now; ``result()`` waits for it."""
        with self._on_side():
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src, group=self.groups[channel])
        return PendingRecv(self, buf, work, f"{what} from {self.peers(src)}", src)

    def _timeout(self, what: str, peer: int | None) -> CommTimeoutError:
        return CommTimeoutError(
            f"{self.peers(self.rank)} waited {self.timeout_s:.0f} s for {what}; "
            "that peer is stuck or dead (parallel.comm_timeout_s sets the limit)", peer
        )

    def wait(self, work, what: str, peer: int | None = None) -> None:
        with waiting_for(peer):
            self._wait(work, what, peer)

    def _wait(self, work, what: str, peer: int | None) -> None:
        if self.stream is None:
            # gloo: completion is only observed inside wait(), which takes a deadline.
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                if "imed out" in str(exc) or "imeout" in str(exc):
                    raise self._timeout(what, peer) from None
                raise
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise self._timeout(what, peer)
            time.sleep(0.0002)
        work.wait()  # the current (compute) stream now waits for the transfer

    def flush_sends(self) -> None:
        """Wait for every outstanding send (called once per step, and before exit)."""
        for work, _, what, dst in self._sends:
            self.wait(work, what, dst)
        self._sends.clear()


class PendingRecv:
    """A message being received into a preallocated buffer."""

    def __init__(self, p2p: P2P, buf: torch.Tensor, work, what: str, src: int | None = None):
        self.p2p, self.buf, self.work, self.what, self.src = p2p, buf, work, what, src

    def result(self) -> torch.Tensor:
        self.p2p.wait(self.work, self.what, self.src)
        if self.p2p.stream is not None:
            cur = torch.cuda.current_stream(self.p2p.device)
            cur.wait_stream(self.p2p.stream)
            self.buf.record_stream(cur)  # allocated on the side stream, used on the compute stream
        return self.buf

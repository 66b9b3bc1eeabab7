"""The inter-engine communicator for one module boundary, seen from one rank.

Upstream side (the upstream engine's last stage): ``send_activation`` splits the output of a
microbatch by sample over the downstream DP replicas that own those samples and sends each piece
asynchronously; ``recv_grad`` gathers the gradient pieces back in sample order. Downstream side
(the downstream engine's first stage): ``recv_activation`` gathers the pieces from the upstream
replicas; ``send_grad`` returns the gradient split the same way. Receives are posted ahead of
need (``prefetch_*``) so the transfer runs while the rank still computes the previous microbatch.

With tensor parallelism, the TP ranks of a stage hold the same boundary tensors, so only TP
index 0 of each side talks across the boundary; it broadcasts what it receives to its TP group.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..topology import ModuleGrid
from .p2p import HEADER, P2P, PendingRecv, empty_like_header, shape_header
from .routes import blocks, routes_from, routes_to, split_rows

ACT, GRAD = 0, 1


class BoundaryComm:
    """One boundary between ``up`` and ``down`` module grids, for the calling rank."""

    def __init__(self, p2p: P2P, up: ModuleGrid, down: ModuleGrid, slot: int, boundary_id: int, tp=None):
        self.p2p, self.up, self.down, self.slot, self.bid = p2p, up, down, slot, boundary_id
        me = p2p.rank
        self.side = "up" if me in up.ranks else "down"
        grid = up if self.side == "up" else down
        _, self.dp, tp_index = grid.coords(me)
        self.tp = tp  # TPContext of this rank's TP group, or None without tensor parallelism
        self.talks = tp_index == 0  # only TP index 0 sends and receives across the boundary
        if not self.talks:
            self.routes, self.peers = [], []
        elif self.side == "up":
            self.routes = routes_from(self.dp, slot, up.dp, down.dp)
            self.peers = [down.rank(stage=0, dp=r.down) for r in self.routes]
        else:
            self.routes = routes_to(self.dp, slot, up.dp, down.dp)
            self.peers = [up.rank(stage=up.pp - 1, dp=r.up) for r in self.routes]
        self.block = blocks(slot, grid.dp)[self.dp]
        self._pending: dict[tuple[int, int], list[PendingRecv]] = {}
        self._piece_rows: dict[int, list[int]] = {}
        self.wait_seconds = 0.0
        self.shapes_seen: set[tuple[int, ...]] = set()  # activation shapes received (diagnostics)

    @property
    def grad_scale(self) -> float:
        """Factor on gradients coming back upstream: each engine averages over its own DP group."""
        return self.up.dp / self.down.dp

    def _tag(self, kind: int, mb: int) -> int:
        return ((self.bid * 2 + kind) << 16) + (mb & 0xFFFF)

    def _post(self, kind: int, mb: int) -> list[PendingRecv]:
        key = (kind, mb)
        if key not in self._pending:
            what = f"{'activation' if kind == ACT else 'gradient'} of microbatch {mb}"
            self._pending[key] = [self.p2p.irecv(src, self._tag(kind, mb), what) for src in self.peers]
        return self._pending[key]

    def _gather(self, kind: int, mb: int) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        pieces = [p.result() for p in self._post(kind, mb)]
        del self._pending[(kind, mb)]
        self.wait_seconds += time.perf_counter() - t0
        return pieces

    def _share(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """TP index 0's tensor on every rank of its TP group (shape first: it varies)."""
        if self.tp is None or self.tp.size == 1:
            return tensor
        t0 = time.perf_counter()
        device = self.p2p.device
        header = shape_header(tensor).to(device) if self.talks else torch.empty(HEADER, dtype=torch.int64, device=device)
        dist.broadcast(header, src=self.tp.root, group=self.tp.group)
        if not self.talks:
            tensor = empty_like_header(header.cpu(), device)
        if tensor.numel():
            tensor = tensor.contiguous()
            dist.broadcast(tensor, src=self.tp.root, group=self.tp.group)
        self.wait_seconds += time.perf_counter() - t0
        return tensor

    def _send_split(self, kind: int, mb: int, tensor: torch.Tensor, sizes: list[int]) -> None:
        what = f"{'activation' if kind == ACT else 'gradient'} of microbatch {mb}"
        for piece, dst in zip(torch.split(tensor, sizes), self.peers):
            self.p2p.isend(piece, dst, self._tag(kind, mb), what)

    # upstream side
    def send_activation(self, mb: int, tensor: torch.Tensor, rows_per_sample: list[int]) -> None:
        if not self.talks:
            return
        sizes = split_rows(rows_per_sample, self.block, [r.samples for r in self.routes])
        if sum(sizes) != tensor.shape[0]:
            raise ValueError(f"boundary output has {tensor.shape[0]} rows but its samples need {sum(sizes)}")
        self._send_split(ACT, mb, tensor, sizes)

    def prefetch_grad(self, mb: int) -> None:
        if self.talks:
            self._post(GRAD, mb)

    def recv_grad(self, mb: int) -> torch.Tensor:
        return self._share(torch.cat(self._gather(GRAD, mb)) if self.talks else None)

    # downstream side
    def prefetch_activation(self, mb: int) -> None:
        if self.talks:
            self._post(ACT, mb)

    def recv_activation(self, mb: int) -> torch.Tensor:
        out = None
        if self.talks:
            pieces = self._gather(ACT, mb)
            self._piece_rows[mb] = [p.shape[0] for p in pieces]
            out = torch.cat(pieces)
        out = self._share(out)
        self.shapes_seen.add(tuple(out.shape))
        return out

    def send_grad(self, mb: int, grad: torch.Tensor) -> None:
        if not self.talks:
            return  # TP index 0 holds the same gradient and sends it
        rows = self._piece_rows.pop(mb)
        if grad.shape[0] != sum(rows):
            # The receiver computed on a stand-in (nothing arrived): nothing flows back either.
            grad = grad.new_zeros((sum(rows), *grad.shape[1:]))
        self._send_split(GRAD, mb, grad, rows)

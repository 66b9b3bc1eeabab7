"""The inter-engine communicator for one module boundary, seen from one rank.

Upstream side (the upstream engine's last stage): ``send_activation`` splits the output of a
microbatch by sample over the downstream DP replicas that own those samples and sends each piece
asynchronously; ``recv_grad`` gathers the gradient pieces back in sample order. Downstream side
(the downstream engine's first stage): ``recv_activation`` gathers the pieces from the upstream
replicas; ``send_grad`` returns the gradient split the same way. Receives are posted ahead of
need (``prefetch_*``) so the transfer runs while the rank still computes the previous microbatch.
"""

from __future__ import annotations

import time

import torch

from ..topology import ModuleGrid
from .p2p import P2P, PendingRecv
from .routes import blocks, routes_from, routes_to, split_rows

ACT, GRAD = 0, 1


class BoundaryComm:
    """One boundary between ``up`` and ``down`` module grids, for the calling rank."""

    def __init__(self, p2p: P2P, up: ModuleGrid, down: ModuleGrid, slot: int, boundary_id: int):
        self.p2p, self.up, self.down, self.slot, self.bid = p2p, up, down, slot, boundary_id
        me = p2p.rank
        self.side = "up" if me in up.ranks else "down"
        grid = up if self.side == "up" else down
        _, self.dp, _ = grid.coords(me)
        if self.side == "up":
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

    def _send_split(self, kind: int, mb: int, tensor: torch.Tensor, sizes: list[int]) -> None:
        what = f"{'activation' if kind == ACT else 'gradient'} of microbatch {mb}"
        for piece, dst in zip(torch.split(tensor, sizes), self.peers):
            self.p2p.isend(piece, dst, self._tag(kind, mb), what)

    # upstream side
    def send_activation(self, mb: int, tensor: torch.Tensor, rows_per_sample: list[int]) -> None:
        sizes = split_rows(rows_per_sample, self.block, [r.samples for r in self.routes])
        if sum(sizes) != tensor.shape[0]:
            raise ValueError(f"boundary output has {tensor.shape[0]} rows but its samples need {sum(sizes)}")
        self._send_split(ACT, mb, tensor, sizes)

    def prefetch_grad(self, mb: int) -> None:
        self._post(GRAD, mb)

    def recv_grad(self, mb: int) -> torch.Tensor:
        return torch.cat(self._gather(GRAD, mb))

    # downstream side
    def prefetch_activation(self, mb: int) -> None:
        self._post(ACT, mb)

    def recv_activation(self, mb: int) -> torch.Tensor:
        pieces = self._gather(ACT, mb)
        self._piece_rows[mb] = [p.shape[0] for p in pieces]
        out = torch.cat(pieces)
        self.shapes_seen.add(tuple(out.shape))
        return out

    def send_grad(self, mb: int, grad: torch.Tensor) -> None:
        rows = self._piece_rows.pop(mb)
        if grad.shape[0] != sum(rows):
            # The receiver computed on a stand-in (nothing arrived): nothing flows back either.
            grad = grad.new_zeros((sum(rows), *grad.shape[1:]))
        self._send_split(GRAD, mb, grad, rows)

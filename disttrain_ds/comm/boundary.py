"""The inter-engine communicator for one module boundary, seen from one rank.

Upstream side (the upstream engine's last stage): ``send_activation`` splits the output of a
microbatch by sample over the downstream DP replicas that own those samples and sends each piece
asynchronously; ``recv_grad`` gathers the gradient pieces back in sample order. Downstream side
(the downstream engine's first stage): ``recv_activation`` gathers the pieces from the upstream
replicas; ``send_grad`` returns the gradient split the same way. Receives are posted ahead of
need (``prefetch_*``) so the transfer runs while the rank still computes.

Every message's shape is known to both ends: its rows come from the per-sample row counts of the
microbatch both hold (``MicroBatch.sample_rows``), its trailing dims and dtype from the model.
Activations travel on the ``activations`` channel and gradients on the ``gradients`` channel
(``p2p.py``); on each, both ends of a pair post one message per microbatch in microbatch order.

With tensor parallelism, the TP ranks of a stage hold the same boundary tensors, so only TP
index 0 of each side talks across the boundary; it broadcasts what it receives to its TP group.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from disttrain_ds.comm.p2p import ACT, GRAD, P2P, PendingRecv, channel
from disttrain_ds.comm.routes import block_owners, owned, pair_links, pieces, row_index
from disttrain_ds.topology import ModuleGrid


class BoundaryComm:
    """One boundary between ``up`` and ``down`` module grids, for the calling rank.

    ``features`` and ``dtype`` describe one row of the boundary tensor (the upstream module's
    output); ``rows_key`` names its per-sample row counts in ``MicroBatch.sample_rows``.
    """

    def __init__(
        self,
        p2p: P2P,
        up: ModuleGrid,
        down: ModuleGrid,
        slot: int,
        rows_key: str,
        features: tuple[int, ...],
        dtype: torch.dtype,
        tp=None,
        backward: bool = True,
    ):
        self.p2p, self.up, self.down, self.slot = p2p, up, down, slot
        self.channels = {kind: channel(kind, up.name, down.name) for kind in (ACT, GRAD)}  # this edge's own lanes
        self.rows_key, self.features, self.dtype = rows_key, tuple(features), dtype
        self.backward = backward  # the upstream module runs backward: gradients cross this boundary
        me = p2p.rank
        self.side = "up" if me in up.ranks else "down"
        grid = up if self.side == "up" else down
        _, self.dp, tp_index = grid.coords(me)
        self.tp = tp  # TPContext of this rank's TP group, or None without tensor parallelism
        # SP index > 0: the lead of its SP group talks and shares (parallel/sequence_parallel.py); the
        # whole TP group of such a rank stands by with placeholders.
        self.sp_lead = grid.sp_index(me) == 0
        self.talks = tp_index == 0 and self.sp_lead  # only TP index 0 of SP index 0 crosses the boundary
        other = down if self.side == "up" else up
        self.peer_ranks = [other.rank(stage=0, dp=r) if self.side == "up" else other.rank(stage=other.pp - 1, dp=r)
                           for r in range(other.dp)]
        self.set_owners(None)
        self._pending: dict[tuple[str, int], list[PendingRecv | None]] = {}
        self.wait_seconds = 0.0
        self.shapes_seen: set[tuple[int, ...]] = set()  # activation shapes received (diagnostics)

    def set_owners(self, owners: list[tuple[Sequence[int], Sequence[int]]] | None) -> None:
        """Per microbatch, the (upstream, downstream) replica of each slot position (per-module
        post-balancing, set before each step); None: both modules' contiguous blocks."""
        self._owners = owners
        self._plans: dict[int, tuple[list[int], list[list[int]]]] = {}

    def _plan(self, mb: int) -> tuple[list[int], list[list[int]]]:
        """This replica's slot positions in microbatch ``mb`` and, for each replica on the other
        side, the indices into them of the samples it holds."""
        if mb not in self._plans:
            if self._owners is None:
                up, down = block_owners(self.slot, self.up.dp), block_owners(self.slot, self.down.dp)
            else:
                up, down = self._owners[mb]
            mine, other = (up, down) if self.side == "up" else (down, up)
            positions = owned(mine, self.dp)
            self._plans[mb] = positions, pieces(positions, other, len(self.peer_ranks))
        return self._plans[mb]

    @property
    def grad_scale(self) -> float:
        """Factor on gradients coming back upstream: each engine averages over its own data axis
        (DP x SP ranks), while the downstream's gradients are per replica."""
        return self.up.data_size / self.down.dp

    def _sizes(self, mb: int, rows_per_sample: list[int]) -> list[int]:
        """Rows of the message to or from each replica on the other side."""
        positions, parts = self._plan(mb)
        if len(rows_per_sample) != len(positions):
            raise ValueError(f"{len(rows_per_sample)} row counts for {len(positions)} samples of this replica")
        return [sum(rows_per_sample[i] for i in part) for part in parts]

    def _post(self, channel: str, mb: int, rows_per_sample: list[int]) -> list[PendingRecv | None]:
        key = (channel, mb)
        if key not in self._pending:
            what = f"{'activation' if channel == ACT else 'gradient'} of microbatch {mb}"
            self._pending[key] = [
                self.p2p.irecv((n, *self.features), self.dtype, src, self.channels[channel], what) if n else None
                for n, src in zip(self._sizes(mb, rows_per_sample), self.peer_ranks)
            ]
        return self._pending[key]

    def _gather(self, channel: str, mb: int, rows_per_sample: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        pending = self._post(channel, mb, rows_per_sample)
        del self._pending[(channel, mb)]
        got = [p.result() for p in pending if p is not None]
        self.wait_seconds += time.perf_counter() - t0
        if not got:  # nothing crosses for these samples
            return torch.empty((0, *self.features), dtype=self.dtype, device=self.p2p.device)
        return self._in_local_order(torch.cat(got), mb, rows_per_sample)

    def _in_local_order(self, out: torch.Tensor, mb: int, rows_per_sample: list[int]) -> torch.Tensor:
        """Received rows, concatenated replica by replica, put in this replica's sample order."""
        _, parts = self._plan(mb)
        order = row_index(rows_per_sample, [i for part in parts for i in part])
        if order == sorted(order):  # contiguous blocks: already in order
            return out
        back = torch.empty_like(out)
        back[torch.tensor(order, device=out.device)] = out
        return back

    def _share(self, tensor: torch.Tensor | None, rows: int) -> torch.Tensor:
        """TP index 0's tensor on every rank of its TP group (all of them know its shape); a
        placeholder of that shape off SP index 0, whose SP lead shares the tensor itself."""
        if not self.sp_lead:
            return torch.zeros((rows, *self.features), dtype=self.dtype, device=self.p2p.device)
        if self.tp is None or self.tp.size == 1:
            return tensor
        t0 = time.perf_counter()
        if not self.talks:
            tensor = torch.empty((rows, *self.features), dtype=self.dtype, device=self.p2p.device)
        if tensor.numel():
            tensor = tensor.contiguous()
            dist.broadcast(tensor, src=self.tp.root, group=self.tp.group)
        self.wait_seconds += time.perf_counter() - t0
        return tensor

    def _send_split(self, channel: str, mb: int, tensor: torch.Tensor, rows_per_sample: list[int]) -> None:
        what = f"{'activation' if channel == ACT else 'gradient'} of microbatch {mb}"
        sizes = self._sizes(mb, rows_per_sample)
        if tuple(tensor.shape) != (sum(sizes), *self.features) or tensor.dtype != self.dtype:
            raise ValueError(
                f"{what}: {tuple(tensor.shape)} {tensor.dtype} does not match what its samples make "
                f"({(sum(sizes), *self.features)} {self.dtype}), so the receiver's buffer would not fit"
            )
        _, parts = self._plan(mb)
        for part, n, dst in zip(parts, sizes, self.peer_ranks):
            if n:
                rows = row_index(rows_per_sample, part)
                piece = tensor.narrow(0, rows[0], n) if rows[-1] - rows[0] == n - 1 else tensor[torch.tensor(rows, device=tensor.device)]
                self.p2p.isend(piece.contiguous(), dst, self.channels[channel], what)

    # upstream side
    def send_activation(self, mb: int, tensor: torch.Tensor, rows_per_sample: list[int]) -> None:
        if self.talks:
            self._send_split(ACT, mb, tensor, rows_per_sample)

    def prefetch_grad(self, mb: int, rows_per_sample: list[int]) -> None:
        if self.talks:
            self._post(GRAD, mb, rows_per_sample)

    def recv_grad(self, mb: int, rows_per_sample: list[int]) -> torch.Tensor:
        out = self._gather(GRAD, mb, rows_per_sample) if self.talks else None
        return self._share(out, sum(rows_per_sample))

    # downstream side
    def prefetch_activation(self, mb: int, rows_per_sample: list[int]) -> None:
        if self.talks:
            self._post(ACT, mb, rows_per_sample)

    def recv_activation(self, mb: int, rows_per_sample: list[int]) -> torch.Tensor:
        out = self._gather(ACT, mb, rows_per_sample) if self.talks else None
        out = self._share(out, sum(rows_per_sample))
        self.shapes_seen.add(tuple(out.shape))
        return out

    def send_grad(self, mb: int, grad: torch.Tensor, rows_per_sample: list[int]) -> None:
        if not self.talks:
            return  # TP index 0 holds the same gradient and sends it
        rows = sum(rows_per_sample)
        if grad.shape[0] != rows:
            # The receiver computed on a stand-in (nothing arrived): nothing flows back either.
            grad = grad.new_zeros((rows, *grad.shape[1:]))
        self._send_split(GRAD, mb, grad.to(self.dtype), rows_per_sample)


def boundary_links(modules: tuple[ModuleGrid, ...], slot: int, backward: dict[str, bool],
                   edges: tuple[tuple[str, str], ...] | None = None,
                   every_pair: bool = False) -> list[tuple[str, int, int]]:
    """Every (channel, low rank, high rank) pair that talks across a boundary, in one global order:
    activations (the edge's own channel, ``p2p.channel``) between the TP-0 ranks of the two modules of every graph edge (``edges``: (upstream,
    downstream) names; None: a chain in ``modules`` order), gradients where upstream runs backward.
    ``every_pair``: each upstream replica with each downstream one (post-balancing may route any
    sample between them); otherwise the pairs whose contiguous blocks share a sample."""
    grids = {m.name: m for m in modules}
    pairs = [(grids[a], grids[b]) for a, b in edges] if edges is not None else list(zip(modules, modules[1:]))
    links = set()
    for up, down in pairs:
        if every_pair:
            replicas = sorted((u, d) for u in range(up.dp) for d in range(down.dp))
        else:
            replicas = sorted(pair_links([block_owners(slot, up.dp)], [block_owners(slot, down.dp)]))
        for u, d in replicas:
            a, b = up.rank(stage=up.pp - 1, dp=u), down.rank(stage=0, dp=d)
            lo, hi = min(a, b), max(a, b)
            links.add((channel(ACT, up.name, down.name), lo, hi))
            if backward[up.name]:
                links.add((channel(GRAD, up.name, down.name), lo, hi))
    return sorted(links, key=lambda link: (link[1], link[2], link[0]))

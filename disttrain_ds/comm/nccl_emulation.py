"""NCCL's point-to-point rules, emulated on gloo, so a protocol can be proven on CPU.

A multi-GPU NCCL job needs one GPU per rank; this emulation lets the CPU test suite (and a user
checking a new layout on a laptop) hold every point-to-point message to NCCL's rules instead of
gloo's lenient ones. Enabled with ``DISTTRAIN_NCCL_EMULATION=1`` on the gloo backend; it replaces
``torch.distributed.{isend,irecv,send,recv,batch_isend_irecv}`` (ours and DeepSpeed's) with:

- **no tags**: every op goes to gloo with tag 0, so messages between two ranks match strictly in
  posting order; a message posted into the wrong receive fails on size or carries wrong data;
- **one ordered lane per (process group, pair of ranks)**, both directions together, drained by
  one thread that runs each op as a *blocking* gloo send/recv: a receive holds the lane until its
  data arrives and later ops to that peer wait behind it, as on NCCL's one stream per pair;
- **rendezvous**: a send completes only once the peer's matching receive runs (gloo's blocking
  send waits for the receiver);
- **blocking communicator set-up**: the first op on a (group, pair) blocks the *posting* thread
  until the peer posts its first op on that pair too, as ``ncclCommInitRank`` does when PyTorch
  creates a pair's communicator lazily;
- ``batch_isend_irecv`` is posted op by op, so it is stricter than NCCL's group call.

Work objects support ``is_completed()`` (true once the op ran) and ``wait(timeout=)``. The lanes
are stopped before the process group is destroyed (gloo aborts the process otherwise).
"""

from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

ENV = "DISTTRAIN_NCCL_EMULATION"

_orig: dict[str, object] = {}
_lanes: dict[tuple[int, int], "_Lane"] = {}
_lock = threading.Lock()


class EmulatedWork:
    """Completion of one emulated op."""

    def __init__(self, what: str):
        self.what = what
        self._done = threading.Event()
        self._exc: BaseException | None = None

    def _finish(self, exc: BaseException | None = None) -> None:
        self._exc = exc
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self):
        return self._exc

    def wait(self, timeout: timedelta | None = None) -> bool:
        secs = None if timeout is None or timeout == timedelta(0) else timeout.total_seconds()
        if not self._done.wait(secs):
            raise RuntimeError(f"emulated NCCL {self.what} timed out after {secs:.0f} s")
        if self._exc is not None:
            raise RuntimeError(f"emulated NCCL {self.what} failed: {self._exc}") from self._exc
        return True


class _Lane(threading.Thread):
    """All ops between this rank and one peer in one group, run in posting order."""

    def __init__(self, group, peer: int):
        super().__init__(daemon=True, name=f"nccl-emulation-lane-{peer}")
        self.group, self.peer = group, peer
        self.ops: queue.Queue = queue.Queue()

    def run(self) -> None:
        while True:
            item = self.ops.get()
            if item is None:
                return
            kind, tensor, work = item
            try:
                if kind == "send":
                    _orig["send"](tensor, self.peer, group=self.group, tag=0)
                else:
                    _orig["recv"](tensor, self.peer, group=self.group, tag=0)
                work._finish()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the work
                work._finish(exc)


def _group(group):
    return group if group is not None else dist.group.WORLD


def _lane(group, peer: int) -> _Lane:
    pg = _group(group)
    key = (id(pg), peer)
    with _lock:
        lane = _lanes.get(key)
        if lane is not None:
            return lane
    # First op on this pair: both ends set up their communicator together (blocking), lower rank first.
    token = torch.zeros(1)
    if dist.get_rank() < peer:
        _orig["send"](token, peer, group=pg, tag=0)
    else:
        _orig["recv"](token, peer, group=pg, tag=0)
    lane = _Lane(pg, peer)
    lane.start()
    with _lock:
        _lanes[key] = lane
    return lane


def _post(kind: str, tensor: torch.Tensor, peer: int | None, group) -> EmulatedWork:
    if peer is None:
        raise NotImplementedError("NCCL has no receive from any source: name the peer rank")
    if peer == dist.get_rank():
        raise ValueError("a rank cannot send to or receive from itself over NCCL point-to-point")
    work = EmulatedWork(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} ({tuple(tensor.shape)})")
    _lane(group, peer).ops.put((kind, tensor, work))
    return work


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _post("send", tensor, dst if group_dst is None else dist.get_global_rank(group, group_dst), group)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _post("recv", tensor, src if group_src is None else dist.get_global_rank(group, group_src), group)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    if src is None and group_src is None:
        raise NotImplementedError("NCCL has no receive from any source: name the peer rank")
    irecv(tensor, src, group, tag, group_src).wait()
    return src if group_src is None else dist.get_global_rank(group, group_src)


def batch_isend_irecv(p2p_op_list):
    works = []
    for op in p2p_op_list:
        fn = isend if op.op in (isend, _orig.get("isend")) else irecv
        works.append(fn(op.tensor, op.peer, op.group, op.tag))
    return works


def shutdown() -> None:
    """Stop every lane after its queued ops (before the process group goes away)."""
    with _lock:
        lanes = list(_lanes.values())
        _lanes.clear()
    for lane in lanes:
        lane.ops.put(None)
    for lane in lanes:
        lane.join(timeout=30)


def _destroy_process_group(group=None):
    if group is None or group is dist.group.WORLD:
        shutdown()
    return _orig["destroy_process_group"](group)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def install() -> None:
    """Route ``torch.distributed``'s point-to-point calls through the emulation (idempotent)."""
    if _orig:
        return
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"{ENV}=1 emulates NCCL on the gloo backend; this job runs {dist.get_backend()}")
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "destroy_process_group"):
        _orig[name] = getattr(dist, name)
    dist.isend, dist.irecv, dist.send, dist.recv = isend, irecv, send, recv
    dist.batch_isend_irecv = batch_isend_irecv
    dist.destroy_process_group = _destroy_process_group

"""NCCL's rules, emulated on gloo, so a protocol and a start-up can be proven on CPU.

A multi-GPU NCCL job needs one GPU per rank; this emulation lets the CPU test suite (and a user
checking a new layout on a laptop) hold every point-to-point message, and every process group's
creation, to NCCL's rules instead of gloo's lenient ones. ``DISTTRAIN_NCCL_EMULATION`` picks how
NCCL starts, which depends on the launcher:

- ``lazy`` (or ``1``): torchrun without a device binding. Communicators are made on first use, one
  per pair of ranks: the first op on a (group, pair) blocks the *posting* thread until the peer
  posts its first op on that pair too (``ncclCommInitRank``), and each (group, pair) is one
  ordered lane, both directions together.
- ``eager``: the ``deepspeed`` launcher, which binds every process to its GPU (``device_id``), or
  this project's own start-up, which binds on every launcher. Torch then makes every later group
  by ``ncclCommSplit`` of the world communicator: a collective of **all** world ranks, in one
  order, members with one colour. Creating a group is emulated as such a split: every rank must
  take part in the same order with the same member list; a rank that does not come, or one that
  makes another group at that point, stops start-up after the deadline with an error naming the
  ranks. Point-to-point ops of a group share its one communicator and stream, so each group is
  **one ordered lane per rank**, whatever the peer.

In both modes:

- **no tags**: every op goes to gloo with tag 0, so messages between two ranks match strictly in
  posting order; a message posted into the wrong receive fails on size or carries wrong data;
- a lane is drained by one thread that runs each op as a *blocking* gloo send/recv: a receive
  holds the lane until its data arrives and later ops wait behind it, as on NCCL's one stream;
- **rendezvous**: a send completes only once the peer's matching receive runs;
- ``batch_isend_irecv`` is posted op by op, so it is stricter than NCCL's group call;
- a lane can be made to fail (``abort_lanes``), as NCCL's watchdog aborts a communicator: every
  queued and later op on it fails, so the waiting rank sees an error instead of a hang.

Work objects support ``is_completed()`` and ``wait(timeout=)``. The lanes are stopped before the
process group is destroyed (gloo aborts the process otherwise).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

ENV = "DISTTRAIN_NCCL_EMULATION"
MODES = ("lazy", "eager")
_SPLIT_PREFIX = "disttrain/emulated-split/"

_orig: dict[str, object] = {}
_lanes: dict[tuple, "_Lane"] = {}
_lock = threading.Lock()
_state = {"mode": "lazy", "split_timeout_s": 300.0, "splits": 0}


class EmulatedStartupError(RuntimeError):
    """Ranks did not make the same process group at the same point of an eager (device-bound) start-up."""


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
    """The ops of one NCCL stream (lazy: one group and peer; eager: one group), run in posting order."""

    def __init__(self, group, name: str):
        super().__init__(daemon=True, name=f"nccl-emulation-lane-{name}")
        self.group = group
        self.ops: queue.Queue = queue.Queue()
        self.aborted: str | None = None

    def run(self) -> None:
        while True:
            item = self.ops.get()
            if item is None:
                return
            kind, tensor, peer, work = item
            if self.aborted:
                work._finish(ConnectionAbortedError(self.aborted))
                continue
            try:
                fn = _orig["send"] if kind == "send" else _orig["recv"]
                fn(tensor, peer, group=self.group, tag=0)
                work._finish()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the work
                work._finish(exc)


def _group(group):
    return group if group is not None else dist.group.WORLD


def _lane(group, peer: int) -> _Lane:
    pg = _group(group)
    eager = _state["mode"] == "eager"
    key = (id(pg),) if eager else (id(pg), peer)
    with _lock:
        lane = _lanes.get(key)
        if lane is not None:
            return lane
    if not eager:
        # Lazy: the first op on this pair sets up its communicator, both ends together (blocking).
        token = torch.zeros(1)
        if dist.get_rank() < peer:
            _orig["send"](token, peer, group=pg, tag=0)
        else:
            _orig["recv"](token, peer, group=pg, tag=0)
    lane = _Lane(pg, "group" if eager else str(peer))
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
    _lane(group, peer).ops.put((kind, tensor, peer, work))
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


def abort_lanes(reason: str) -> None:
    """Fail every queued and later op, as NCCL's watchdog aborts a timed-out communicator (ops
    already running in gloo end at gloo's own timeout)."""
    with _lock:
        lanes = list(_lanes.values())
    for lane in lanes:
        lane.aborted = reason


# -- eager start-up: group creation as a world-wide split ---------------------------------------


def split_joiners(members: list[int], world: int, backend: str | None, local: bool) -> list[int]:
    """Which world ranks call ``ncclCommSplit`` when torch makes this group on a device-bound world
    (``distributed_c10d._new_process_group_helper``): members of an NCCL group and every non-member
    (with no colour); for a gloo group only the non-members (a gloo group makes no NCCL
    communicator, but torch still splits off its non-members); with ``use_local_synchronization``
    only the members, as non-members return before the split."""
    if local:
        return list(members)
    outside = [r for r in range(world) if r not in set(members)]
    if backend is not None and str(backend).lower() == "gloo":
        return outside
    return list(range(world))


def _store():
    return dist.distributed_c10d._get_default_store()


def split_problem(entries: dict[int, dict], world: int) -> str | None:
    """What went wrong in one emulated split, from what each rank that came made; None if all agree."""
    missing = [r for r in range(world) if r not in entries]
    if missing:
        came = sorted(entries)
        making = {json.dumps(e["ranks"]) for e in entries.values()}
        return (f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} did not take part "
                f"(rank{'s' if len(came) > 1 else ''} {_ranks(came)} made the group of ranks "
                f"{' / '.join(sorted(making))})")
    by_group: dict[str, list[int]] = {}
    for r, e in sorted(entries.items()):
        by_group.setdefault(json.dumps(e["ranks"]), []).append(r)
    if len(by_group) > 1:
        return "ranks made different groups at this point: " + "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} the group of ranks {g}" for g, rs in by_group.items())
    return None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{', '.join(map(str, ranks[:8]))} and {len(ranks) - 8} more"


def _split(members: list[int], timeout_s: float) -> None:
    """Take part in one emulated world-wide split; raise ``EmulatedStartupError`` naming the ranks
    that did not come, or that made another group, within ``timeout_s``."""
    seq = _state["splits"]
    _state["splits"] += 1
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    store.set(f"{_SPLIT_PREFIX}{seq}/{rank}", json.dumps({"ranks": members}))
    keys = [f"{_SPLIT_PREFIX}{seq}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a timeout: find out who is missing below
        pass
    entries = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
    problem = split_problem(entries, world)
    if problem:
        raise EmulatedStartupError(
            f"emulated NCCL start-up: group split #{seq} on rank {rank}, after {timeout_s:.0f} s: {problem}; "
            "on a device-bound world every rank must make every process group, in one order")


def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
              group_desc=None, device_id=None, sort_ranks=True):
    """``torch.distributed.new_group`` with an eager start-up's world-wide split in front."""
    world = dist.get_world_size()
    members = sorted(ranks) if ranks is not None else list(range(world))
    if dist.get_rank() in split_joiners(members, world, backend, use_local_synchronization):
        wait_s = timeout.total_seconds() if timeout is not None else _state["split_timeout_s"]
        _split(members, wait_s)
    return _orig["new_group"](ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                              use_local_synchronization=use_local_synchronization, group_desc=group_desc,
                              device_id=device_id, sort_ranks=sort_ranks)


# -- install / shut down -------------------------------------------------------------------------


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


def mode() -> str | None:
    """``lazy``, ``eager`` or None (off) from ``DISTTRAIN_NCCL_EMULATION``; one line on a bad value."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0"):
        return None
    if value == "1":
        return "lazy"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected lazy (or 1), eager, or 0")
    return value


def enabled() -> bool:
    return mode() is not None


def installed() -> str | None:
    """The mode installed in this process, or None."""
    return _state["mode"] if _orig else None


def install(emulated: str | None = None, split_timeout_s: float = 300.0) -> None:
    """Route ``torch.distributed``'s point-to-point calls (and, eager, group creation) through the
    emulation (idempotent). ``emulated``: the mode, default from the environment."""
    if _orig:
        return
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"{ENV} emulates NCCL on the gloo backend; this job runs {dist.get_backend()}")
    _state.update(mode=emulated or mode() or "lazy", split_timeout_s=split_timeout_s, splits=0)
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "destroy_process_group", "new_group"):
        _orig[name] = getattr(dist, name)
    dist.isend, dist.irecv, dist.send, dist.recv = isend, irecv, send, recv
    dist.batch_isend_irecv = batch_isend_irecv
    dist.destroy_process_group = _destroy_process_group
    if _state["mode"] == "eager":
        dist.new_group = new_group

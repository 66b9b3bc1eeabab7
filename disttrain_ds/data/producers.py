"""Disaggregated preprocessing: whole global batches prepared in producer processes.

With ``data.producers = P > 0``, producer ``k`` builds its own copy of the source and prepares
steps ``k, k + P, k + 2P, ...`` (decode, resize, tokenise, pack and, with ``data.reorder``,
reorder), each into its own bounded queue; together the queues hold about ``data.queue_depth``
batches ahead of training. The trainer reads step ``s`` from queue ``s % P``, so batches arrive in
step order and equal the in-process ones. ``last_wait_seconds`` is how long the trainer blocked.
With ``P = 0`` the same wrapper prepares batches in the trainer process.

In a multi-rank job with ``data.share: node`` only one rank per host runs the producers; they
write batches to a spool in shared memory that every rank on the host reads (``spool.py``).
"""

from __future__ import annotations

import queue
import socket
import time
import weakref
from typing import Any

from disttrain_ds.data import spool
from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producer_worker import POLL_S, Job, decode, prepare, produce, start_context
from disttrain_ds.data.registry import open_source, resolve
from disttrain_ds.data.source import SampleSource
from disttrain_ds.data.split import TRAIN, Split
from disttrain_ds.data.spool import NodeShare, SpoolError, SpoolWriter
from disttrain_ds.samples import PackedSample, ShapeSpec

STALL_TIMEOUT_S = 20.0
"""Default ``ProducedSource.stall_timeout_s`` (the default ``parallel.heartbeat_timeout_s``)."""


class ProducerError(RuntimeError):
    """A producer process failed; ``details`` holds its traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class ProducedSource(SampleSource):
    """The trainer's view of a source: batches in step order, from producers or in-process."""

    def __init__(self, cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, split: Split = TRAIN):
        if cfg.producers < 0:
            raise ValueError(f"data.producers: must be >= 0, got {cfg.producers}")
        if cfg.queue_depth < 1:
            raise ValueError(f"data.queue_depth: must be >= 1, got {cfg.queue_depth}")
        self.cfg, self.shape, self.batch, self.seed, self.split = cfg, shape, global_batch, seed, split
        self.inner = open_source(cfg, shape, global_batch, seed, split)  # vocabulary, describe, in-process batches
        self.special, self.base_vocab = self.inner.special, self.inner.base_vocab
        self.last_wait_seconds = 0.0
        self.stall_timeout_s = STALL_TIMEOUT_S
        """A producer whose heartbeat stops this long while its batch is due has failed."""
        self.share: NodeShare | None = None
        self.host_units: tuple[int, ...] | None = None
        """The units this host reads (``read_only``); None: whole batches."""
        self._order = None
        self._procs: list[Any] = []
        self._queues: list[Any] = []
        self._beats: list[Any] = []
        self._seen: list[tuple[int, float]] = []  # per producer: (last heartbeat value, monotonic time it changed)
        self._stop = None
        self._finalizer: weakref.finalize | None = None
        self._spool_finalizer: weakref.finalize | None = None
        self._next = 0
        self._inner_state: dict | None = None
        self._plan_skips: dict[str, int] = {}
        self._extra: dict[str, int] = {}

    def describe(self) -> str:
        procs = f"{self.cfg.producers} producer process{'es' if self.cfg.producers != 1 else ''}"
        if not self.cfg.producers:
            where = "in-process"
        elif self.share is not None:
            n = len(self.share.readers)
            where = f"by {procs} per host, shared by its {n} ranks through {self.share.directory}"
        else:
            where = f"by {procs}"
        read = ""
        if self.host_units is not None:
            units = self.inner.units() or []
            n = sum(len(units[j]) for j in self.host_units)
            read = f", each host reading only its ranks' samples (this host: {n} of {self.batch})"
        return f"{self.inner.describe()}, prepared {where}" + (", reordered" if self.cfg.reorder else "") + read

    def read_only(self, units: tuple[int, ...]) -> None:
        """Read only these units of every batch (``data.read: host``), unreordered; other positions are None."""
        self.close()
        self.host_units = tuple(units)

    def order_with(self, order) -> None:
        """Pass every batch through ``order`` (the host-constrained reordering, ``reorder/host_order.py``)."""
        self._order = order

    def share_with(self, share: NodeShare) -> None:
        """Read batches from the host's spool; the host's leader rank runs the producers for all."""
        if not self.cfg.producers:
            raise ValueError("data.share: a shared spool needs data.producers > 0")
        self.close()
        self.share = share
        if share.leader:
            try:
                spool.create(share)
            except SpoolError as exc:
                raise ProducerError(str(exc)) from None
            self._spool_finalizer = weakref.finalize(self, spool.remove, share.directory)

    def release_spool(self) -> None:
        """Leader: remove the spool once every rank of the host is done with it."""
        if self._spool_finalizer is not None:
            self._spool_finalizer()

    # ----------------------------------------------------------------- producers

    def _start(self, step: int) -> None:
        # A VAE in the producers: diffusers is imported once in the server (tens of seconds on a
        # loaded host), not by each producer while its heartbeat is watched.
        ctx, n = start_context(("disttrain_ds.models.vae",) if self.shape.vae is not None else ()), self.cfg.producers
        self._stop = ctx.Event()
        writer = None
        if self.share is not None:
            spool.reset(self.share.directory)
            writer = SpoolWriter(self.share.directory, self.share.readers, self.cfg.queue_depth, step)
            self._queues = [None] * n
        else:
            depth = max(1, -(-self.cfg.queue_depth // n))
            self._queues = [ctx.Queue(maxsize=depth) for _ in range(n)]
        self._beats = [ctx.RawValue("Q", 0) for _ in range(n)]
        for k in range(n):
            job = Job(self.cfg, self.shape, self.batch, self.seed, step + k, n, self._inner_state, self.split,
                       self.host_units)
            proc = ctx.Process(target=produce, args=(job, self._queues[k], self._stop, writer, k, self._beats[k]),
                               daemon=True, name=f"data-producer-{k}")
            proc.start()
            self._procs.append(proc)
        self._seen = [(0, time.monotonic()) for _ in range(n)]  # once started (the first start waits for the server)
        self._finalizer = weakref.finalize(self, _shutdown, list(self._procs), list(self._queues), self._stop)

    def _stalled(self, k: int, step: int) -> str | None:
        """Why producer ``k`` is alive but has failed (its heartbeat stopped: stopped or hung), or None."""
        value, now = self._beats[k].value, time.monotonic()
        last, since = self._seen[k]
        if value != last:
            self._seen[k] = (value, now)
            return None
        if now - since <= self.stall_timeout_s or not self._procs[k].is_alive():
            return None
        proc = self._procs[k]
        proc.kill()  # a stopped process ignores everything else; it must not outlive the job
        return (f"producer {k} (pid {proc.pid}, host {socket.gethostname()}) stopped making progress: "
                f"no heartbeat for {now - since:.0f} s (stopped or hung) while step {step} was due")

    def _receive(self, step: int) -> tuple:
        k = step % len(self._procs)
        proc, q = self._procs[k], self._queues[k]
        while True:
            try:
                msg = q.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not proc.is_alive():
                    try:  # it may have put its last message just before exiting
                        msg = q.get(timeout=POLL_S)
                        break
                    except queue.Empty:
                        self.close()
                        why = f"producer {k} exited (code {proc.exitcode}) before step {step}"
                        raise ProducerError(f"data.producers: {why}") from None
                stalled = self._stalled(k, step)
                if stalled:
                    self.close()
                    raise ProducerError(f"data.producers: {stalled}") from None
        if msg[0] == "error":
            self.close()
            raise ProducerError(f"data.producers: producer {k} failed at step {msg[1]}: {msg[2]}", msg[3])
        if msg[1] != step:
            self.close()
            raise ProducerError(f"data.producers: producer {k} sent step {msg[1]} when step {step} was due")
        return msg

    def _fetch_shared(self, step: int) -> tuple:
        share = self.share
        assert share is not None

        def producers_gone() -> str | None:  # the leader's own producers; other ranks watch the leader
            for k, proc in enumerate(self._procs):
                if not proc.is_alive():
                    return f"producer {k} exited (code {proc.exitcode}) before step {step}"
            for k in range(len(self._procs)):
                stalled = self._stalled(k, step)
                if stalled:
                    return stalled
            return None

        try:
            batch = spool.fetch(share, step, producers_gone)
        except SpoolError as exc:
            self.close()
            raise ProducerError(f"data.producers: {exc}", exc.details) from None
        if share.leader:
            spool.collect(share.directory, share.readers)
        return batch.samples, batch.plan, batch.extra, batch.state

    def global_batch(self, step: int) -> list[PackedSample]:
        t0 = time.perf_counter()
        if self.cfg.producers == 0:
            samples = prepare(self.inner, step, self.cfg, self.shape, self.host_units)
            plan, extra, state = *self.inner.step_skips(step), None
        else:
            runs_producers = self.share is None or self.share.leader
            if self._procs and step != self._next:
                self.close()  # out-of-order request: restart the producers at this step
            if runs_producers and not self._procs:
                if step != self._next:
                    self._inner_state = None  # the saved state is for another step: plan from the start
                self._start(step)
            if self.share is not None:
                samples, plan, extra, state = self._fetch_shared(step)
            else:
                _, _, payload, plan, extra, state = self._receive(step)
                samples = decode(payload)
        if self._order is not None:
            samples = self._order(samples)
        self._next = step + 1
        self._inner_state = state
        self._plan_skips = plan
        for key, n in extra.items():
            self._extra[key] = self._extra.get(key, 0) + n
        self.last_wait_seconds = time.perf_counter() - t0
        return samples

    # ----------------------------------------------------------------- accounting, state, shutdown

    def skip_counts(self) -> dict[str, int]:
        total = dict(self._plan_skips)
        for key, n in self._extra.items():
            total[key] = total.get(key, 0) + n
        return {k: v for k, v in sorted(total.items()) if v}

    def state_dict(self) -> dict:
        inner = self.inner.state_dict() if self.cfg.producers == 0 else self._inner_state
        return {"next_step": self._next, "inner": inner or {}, "extra_skips": dict(self._extra), "plan_skips": dict(self._plan_skips)}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._next = int(state["next_step"])
        self._inner_state = state.get("inner") or None
        self._extra = dict(state.get("extra_skips", {}))
        self._plan_skips = dict(state.get("plan_skips", {}))
        if self._inner_state:
            self.inner.load_state_dict(self._inner_state)  # also checks it matches this data setup

    def close(self) -> None:
        """Stop the producers (a shared spool stays until ``release_spool`` or exit)."""
        if self._procs:
            self._finalizer()  # runs _shutdown once; also registered for garbage collection and exit
        self._procs, self._queues, self._beats, self._seen = [], [], [], []


def _shutdown(procs: list, queues: list, stop) -> None:
    """Stop, drain and join producers (terminating any that do not stop within a few seconds)."""
    stop.set()
    deadline = time.monotonic() + 5.0
    for proc, q in zip(procs, queues):
        while proc.is_alive() and time.monotonic() < deadline:
            if q is None:  # spool writers poll the stop flag
                proc.join(timeout=POLL_S)
                continue
            try:  # drain so a producer blocked on a full queue sees the stop flag
                q.get_nowait()
            except queue.Empty:
                proc.join(timeout=POLL_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():  # a stopped process does not act on SIGTERM
            proc.kill()
            proc.join(timeout=2.0)
        if q is not None:
            q.close()
            q.cancel_join_thread()


def build_source(cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, split: Split = TRAIN) -> SampleSource:
    """The source named by ``cfg.source``, prepared in ``cfg.producers`` processes (0: in-process);
    ``split``: its training part (less any held-out records) or its held-out part (``data/split.py``)."""
    return ProducedSource(resolve(cfg), shape, global_batch, seed, split)

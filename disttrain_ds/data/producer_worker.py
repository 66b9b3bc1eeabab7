"""The producer process's side of disaggregated preprocessing: prepare every ``stride``-th global
batch from its own copy of the source into a queue (or the host's spool), with a heartbeat the
trainer watches; ``prepare`` is also what the trainer runs in-process (``data.producers: 0``)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.registry import open_source
from disttrain_ds.data.source import SampleSource
from disttrain_ds.data.split import TRAIN, Split
from disttrain_ds.data.spool import SpoolBatch, SpoolWriter
from disttrain_ds.reorder.inter import reorder_batch
from disttrain_ds.samples import PackedSample, ShapeSpec

POLL_S = 0.2
"""How long a queue operation waits before looking whether to stop."""
BEAT_S = 0.5
"""How often a producer's heartbeat thread bumps its counter."""
PRELOAD = ["torch", "numpy", "PIL.Image", "datasets", "disttrain_ds.data.record_source"]
"""Modules the fork server imports once, so every producer forks with them loaded."""


@dataclass(frozen=True)
class Job:
    """What one producer prepares: its steps (``first_step``, then every ``stride``-th) of one source."""

    cfg: DataConfig
    shape: ShapeSpec
    batch: int
    seed: int
    first_step: int
    stride: int
    state: dict | None
    split: Split = TRAIN
    units: tuple[int, ...] | None = None
    """The units of each batch this host reads (``data/host_read.py``); None: whole batches."""


def encode(samples: list[PackedSample | None]) -> list[tuple | None]:
    """Tensors as numpy arrays: plain pickling, no shared-memory file descriptors to leak."""
    return [
        (s.input_ids.numpy(), s.labels.numpy(), [im.numpy() for im in s.images], [t.numpy() for t in s.gen_targets],
         s.sample_id, s.doc_lens, s.meta, [c.numpy() for c in s.audio])
        if s is not None else None
        for s in samples
    ]


def decode(payload: list[tuple | None]) -> list[PackedSample | None]:
    return [
        PackedSample(torch.from_numpy(p[0]), torch.from_numpy(p[1]), [torch.from_numpy(im) for im in p[2]],
                     [torch.from_numpy(t) for t in p[3]], p[4], tuple(p[5]), p[6], [torch.from_numpy(c) for c in p[7]])
        if p is not None else None
        for p in payload
    ]


def prepare(source: SampleSource, step: int, cfg: DataConfig, shape: ShapeSpec,
            units: tuple[int, ...] | None = None) -> list[PackedSample | None]:
    """One global batch, reordered when ``data.reorder`` is set; with ``units``, only the samples
    of those units (None at every other position), unreordered (``order_with`` reorders them)."""
    if units is not None:
        got = source.read_units(step, list(units))
        return [got.get(p) for p in range(source.batch)]
    samples = source.global_batch(step)
    if cfg.reorder:
        samples = reorder_batch(samples, shape, source.special)
    return samples


def keep_going(stop) -> bool:
    """Not told to stop, and the trainer is alive (an orphan exits instead of blocking forever)."""
    parent = mp.parent_process()
    return not stop.is_set() and (parent is None or parent.is_alive())


def put(q, item, stop) -> bool:
    while keep_going(stop):
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def heartbeat(beat) -> None:
    """Bump ``beat`` while this process runs (it stops when the process is stopped, killed or wedged)."""
    while True:
        beat.value += 1
        time.sleep(BEAT_S)


def produce(job: Job, q, stop, writer: SpoolWriter | None = None, index: int = 0, beat=None) -> None:
    """Prepare steps ``first_step, first_step + stride, ...`` into queue ``q`` or the spool ``writer``."""
    step = job.first_step
    if beat is not None:
        threading.Thread(target=heartbeat, args=(beat,), name="producer-heartbeat", daemon=True).start()
    try:
        source = open_source(job.cfg, job.shape, job.batch, job.seed, job.split)
        if job.state:
            source.load_state_dict(job.state)
        while not stop.is_set():
            samples = prepare(source, step, job.cfg, job.shape, job.units)
            plan, extra = source.step_skips(step)
            if writer is not None:
                batch = SpoolBatch(step, samples, plan, extra, source.state_dict())
                sent = writer.put(batch, lambda: keep_going(stop))
            else:
                sent = put(q, ("ok", step, encode(samples), plan, extra, source.state_dict()), stop)
            if not sent:
                break
            step += job.stride
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the trainer
        line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        if writer is not None:
            writer.error(index, step, line, traceback.format_exc())
        else:
            put(q, ("error", step, line, traceback.format_exc()), stop)
    finally:
        parent = mp.parent_process()
        if q is not None and parent is not None and not parent.is_alive():
            q.cancel_join_thread()  # nobody will read: do not hang at exit flushing the queue
        # Otherwise exit flushes what was put (the error message above) while the trainer reads.


def start_context(extra: tuple[str, ...] = ()):
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD + list(extra))  # producers fork from a server with torch imported
        return ctx
    return mp.get_context("spawn")

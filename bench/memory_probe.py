"""One training rank with its memory recorded per phase (``bench/bench_memory.py`` launches it
under torchrun in place of ``tools/train.py``).

    torchrun ... bench/memory_probe.py --recipe tiny_cpu key=value ...   (PROBE_DIR=dir)

Before the recipe is read, every library a rank imports is imported, and the process's resident
memory then is its *baseline* (Python, torch, DeepSpeed, transformers, diffusers). Each phase a
rank goes through is wrapped: building its pipeline layers (``construction``: the whole layers,
then their TP shards), ``deepspeed.initialize``'s work (``engine``: optimizer states, gradient
buffers), and, per 1F1B instruction, ``forward``, ``backward``, ``reduce`` (DP all-reduce) and
``step`` (optimizer). Peak resident memory (``ru_maxrss``) never falls, so a phase's share of the
peak is how much it raised it; ``live`` is what the C allocator holds for the process at the end of
the phase (glibc's ``mallinfo2``: bytes in use, mmapped chunks included), which freed tensors
leave. Each rank writes ``PROBE_DIR/rank<r>.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def peak_bytes() -> int:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """The process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_bytes() -> int:
    """Bytes the C allocator has handed out and not had back (heap chunks in use + mmapped chunks)."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class Phases:
    """Per phase: how much it raised the peak, and the most live bytes seen during it (a thread
    samples ``live_bytes`` every ``PROBE_SAMPLE_MS``, default 1 ms; torch's kernels release the
    GIL, so it sees the temporaries inside a forward or backward)."""

    def __init__(self) -> None:
        self.baseline = {"peak": peak_bytes(), "rss": rss_bytes(), "live": live_bytes()}
        self.raised: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.phase = "start"
        self.every = float(os.environ.get("PROBE_SAMPLE_MS", "1")) / 1000
        threading.Thread(target=self._sample, daemon=True).start()

    def _note(self) -> None:
        self.live[self.phase] = max(self.live.get(self.phase, 0), live_bytes())

    def _sample(self) -> None:
        while True:
            self._note()
            time.sleep(self.every)

    def wrap(self, name: str, fn):
        def run(*args, **kwargs):
            before, outer = peak_bytes(), self.phase
            self.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                self._note()
                self.phase = outer
                self.raised[name] = self.raised.get(name, 0) + peak_bytes() - before
                self.calls[name] = self.calls.get(name, 0) + 1
        return run

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({"baseline": self.baseline, "raised": self.raised,
                                    "live": self.live, "calls": self.calls, "peak": peak_bytes(),
                                    "live_end": live_bytes()}))


def install(phases: Phases) -> None:
    """Wrap the runtime's phases (the engine's instruction map and its two builders)."""
    from deepspeed.runtime.pipe import schedule as ds

    from disttrain_ds.parallel import engine
    from disttrain_ds.runtime import distributed

    distributed.build_pipeline_module = phases.wrap("construction", engine.build_pipeline_module)
    distributed.make_engine = phases.wrap("engine", engine.make_engine)
    table = engine.ModuleEngine._DISAGG_MAP
    for instr, name in ((ds.ForwardPass, "forward"), (ds.BackwardPass, "backward"),
                        (ds.ReduceGrads, "reduce"), (ds.OptimizerStep, "step")):
        table[instr] = phases.wrap(name, table[instr])


def main() -> int:
    import deepspeed  # noqa: F401  everything a rank imports, before the baseline
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    from disttrain_ds.cli.train import main as train
    from disttrain_ds.runtime import distributed  # noqa: F401

    phases = Phases()
    install(phases)
    t0 = time.time()
    try:
        return train()
    finally:
        phases.baseline["wall_s"] = time.time() - t0
        out = Path(os.environ["PROBE_DIR"])
        phases.dump(out / f"rank{os.environ.get('RANK', '0')}.json")


if __name__ == "__main__":
    sys.exit(main())

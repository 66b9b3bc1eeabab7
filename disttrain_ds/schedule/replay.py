"""The simulator side of emulated compute: what the ranks waited for, replayed in the 1F1B simulator.

``Emulator`` (``runtime/emulate.py``) records every rank's op times per step; this module loads
those records, turns them into the planner simulator's stage tables (DP replicas in lock-step) or
simulates every rank on its own timeline with the dependencies of the real layout (fan-in/out
included), and measures the runtime's overheads beyond the emulated time from a run's trace.
``bench/emulated.py`` compares the measured iteration with both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from disttrain_ds.comm.routes import blocks
from disttrain_ds.schedule.simulate import BWD, FWD, SimResult, simulate_1f1b, stage_order
from disttrain_ds.schedule.timeline import read_trace_events


@dataclass(frozen=True)
class RankCosts:
    """Emulated op times of one rank for one step (what it waited for)."""

    rank: int
    """Global rank."""
    module: str
    """The module's name in the recipe's graph."""
    global_stage: int
    """Index of the rank's stage in the pipeline over all modules."""
    dp: int
    """The rank's data-parallel replica."""
    fwd_ms: tuple[float, ...]
    """Forward time of each microbatch, in execution order."""
    bwd_ms: tuple[float, ...]
    """Backward time of each microbatch (0 where the module runs no backward)."""
    prep_ms: float = 0.0
    """Time from the step's start to the first instruction (data wait and collation)."""
    peers: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """At a module boundary under per-module post-balancing: the other module's name -> per
    microbatch, the replicas of it this rank exchanges units with (empty: contiguous blocks)."""


def stage_tables(ranks: Sequence[RankCosts], total_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``[K, P]`` forward and backward times per microbatch and pipeline stage, DP replicas in
    lock-step (a stage's time is its slowest replica's), as the planner's simulator assumes."""
    if not ranks:
        raise ValueError("no rank costs")
    k = len(ranks[0].fwd_ms)
    fwd, bwd = np.zeros((k, total_stages)), np.zeros((k, total_stages))
    seen = set()
    for r in ranks:
        if len(r.fwd_ms) != k or len(r.bwd_ms) != k:
            raise ValueError(f"{r.module} stage {r.global_stage}: {len(r.fwd_ms)} microbatches, expected {k}")
        fwd[:, r.global_stage] = np.maximum(fwd[:, r.global_stage], r.fwd_ms)
        bwd[:, r.global_stage] = np.maximum(bwd[:, r.global_stage], r.bwd_ms)
        seen.add(r.global_stage)
    if len(seen) != total_stages:
        raise ValueError(f"costs cover stages {sorted(seen)}, expected 0..{total_stages - 1}")
    return fwd, bwd


@dataclass(frozen=True)
class Overheads:
    """Runtime costs outside the emulated compute, measured on the runs themselves (ms)."""

    op_ms: float = 0.0
    """Added to every forward and backward: bookkeeping, sleep overshoot, DeepSpeed's blocking sends."""
    comm_ms: float = 0.0
    """Latency of one pipeline crossing (activation or gradient) beyond the producing op's end."""
    tail_ms: tuple[float, ...] = ()
    """Per pipeline stage, after its last backward: gradient all-reduce and optimizer step."""
    prep: bool = False
    """Start each rank after its recorded data preparation (``RankCosts.prep_ms``) of the step."""


def simulate_step(ranks: Sequence[RankCosts], total_stages: int,
                  overheads: Overheads = Overheads()) -> tuple[float, SimResult]:
    """Simulated iteration time (ms) of one step and its 1F1B timeline: the planner's simulator on
    the stage tables, each op lengthened by ``op_ms`` and each crossing by ``comm_ms``; the
    iteration ends when the last stage finishes its tail and, with ``prep``, starts once the
    first stage's slowest replica has its data."""
    fwd, bwd = stage_tables(ranks, total_stages)
    o = overheads
    res = simulate_1f1b(fwd + o.op_ms, bwd + o.op_ms, comm=o.comm_ms if total_stages > 1 else None)
    tails = np.zeros(total_stages) if not o.tail_ms else np.asarray(o.tail_ms, dtype=np.float64)
    if tails.shape != (total_stages,):
        raise ValueError(f"tail_ms needs one value per stage ({total_stages}), got {len(tails)}")
    ends = np.zeros(total_stages)
    for e in res.events:
        ends[e.stage] = max(ends[e.stage], e.end)
    head = max(r.prep_ms for r in ranks if r.global_stage == 0) if o.prep else 0.0
    return head + float((ends + tails).max()), res


def links(ranks: Sequence[RankCosts], slot: int) -> dict[tuple[int, int, int], list[int]]:
    """``(rank, FWD, i)`` -> ranks whose forward output of microbatch ``i`` it receives;
    ``(rank, BWD, i)`` -> ranks whose input gradient of it it receives. Inside a module: the same
    replica's neighbouring stage; across a module boundary (a module's last stage right before
    another's first, as the graph's stage offsets lay a star out: every encoder ends where the LLM
    starts, every generator starts where it ends): every replica it exchanges units with in that
    microbatch (``RankCosts.peers``, post-balancing), else every replica whose DP block of the
    ``slot`` samples overlaps its own. Two modules on different paths (two encoders, two
    generators) never feed each other."""
    span = {m: (min(r.global_stage for r in ranks if r.module == m), max(r.global_stage for r in ranks if r.module == m))
            for m in {r.module for r in ranks}}
    dps = {m: len({r.dp for r in ranks if r.module == m}) for m in span}

    def feeds(u: RankCosts, d: RankCosts, i: int) -> bool:  # u (stage g) sends activations to d (stage g + 1)
        if u.module == d.module:
            return u.dp == d.dp
        if u.global_stage != span[u.module][1] or d.global_stage != span[d.module][0]:
            return False
        if d.module in u.peers:
            return d.dp in u.peers[d.module][i]
        if u.module in d.peers:
            return u.dp in d.peers[u.module][i]
        bu, bd = blocks(slot, dps[u.module])[u.dp], blocks(slot, dps[d.module])[d.dp]
        return bu.start < bd.stop and bd.start < bu.stop

    k = len(ranks[0].fwd_ms)
    return {(r.rank, kind, i): [x.rank for x in ranks if x.global_stage == r.global_stage + (1 if kind else -1)
                                and (feeds(r, x, i) if kind else feeds(x, r, i))]
            for r in ranks for kind in (FWD, BWD) for i in range(k)}


def talkers(ranks: Sequence[RankCosts]) -> list[RankCosts]:
    """One rank per (module, stage, replica): the lowest, TP and SP index 0, which talks across
    boundaries; its TP and SP peers run each op in step with it through their collectives (an SP
    member's op also holds its wait for the lead's inputs), so they are not timelines of their own."""
    seen: dict[tuple[str, int, int], RankCosts] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        seen.setdefault((r.module, r.global_stage, r.dp), r)
    return sorted(seen.values(), key=lambda r: r.rank)


def simulate_ranks(ranks: Sequence[RankCosts], slot: int,
                   overheads: Overheads = Overheads()) -> tuple[float, list[dict]]:
    """Like :func:`simulate_step`, with every rank its own timeline instead of lock-step
    replicas: each rank runs its stage's 1F1B op order (``stage_order``), an op starting once
    the rank is free (with ``prep``: no earlier than its data preparation) and the ranks it
    receives from (:func:`links`) have produced that microbatch plus ``comm_ms``. Returns the
    time and every op as a timeline event. TP and SP peers follow their talker (:func:`talkers`)."""
    ranks = talkers(ranks)
    k, p, o = len(ranks[0].fwd_ms), 1 + max(r.global_stage for r in ranks), overheads
    deps, tails = links(ranks, slot), o.tail_ms or (0.0,) * p
    todo = {r.rank: stage_order(k, p, r.global_stage) for r in ranks}
    free, done, events = {r.rank: r.prep_ms if o.prep else 0.0 for r in ranks}, {}, []
    while any(todo.values()):
        progressed = False
        for r in ranks:
            while todo[r.rank]:
                kind, i = todo[r.rank][0]
                srcs = deps[(r.rank, kind, i)]
                if any((x, kind, i) not in done for x in srcs):
                    break
                start = max([free[r.rank]] + [done[(x, kind, i)] + o.comm_ms for x in srcs])
                end = start + (r.fwd_ms if kind == FWD else r.bwd_ms)[i] + o.op_ms
                done[(r.rank, kind, i)] = free[r.rank] = end
                events.append({"rank": r.rank, "stage": r.global_stage, "name": ("fwd", "bwd")[kind],
                               "microbatch": i, "start": start, "end": end})
                todo[r.rank].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("rank dependency cycle")
    return max(free[r.rank] + tails[r.global_stage] for r in ranks), events


def crossing_latencies(spans: dict[int, list[dict]], ranks: Sequence[RankCosts], slot: int) -> list[float]:
    """Latency (ms) of every pipeline crossing in one step's trace whose receiver waited (the
    receive was posted before its data was produced): receive end - the latest end of the
    producing ops (:func:`links`). ``spans`` as :func:`measure_overheads` takes them."""
    ranks = talkers(ranks)
    spans = {r.rank: spans[r.rank] for r in ranks if r.rank in spans}
    deps = links(ranks, slot)
    ends = {(rank, x["name"], x["mb"]): x["end"] for rank, sp in spans.items() for x in sp
            if x["name"] in ("forward", "backward")}
    out = []
    for rank, sp in spans.items():
        for i, x in enumerate(sp):
            nxt = next((y for y in sp[i + 1:] if y["name"] in ("forward", "backward") and y["mb"] == x["mb"]), None)
            if x["name"] != "recv" or nxt is None:
                continue
            kind = FWD if nxt["name"] == "forward" else BWD
            produced = [ends.get((u, nxt["name"], x["mb"])) for u in deps.get((rank, kind, x["mb"]), [])]
            if produced and None not in produced and x["start"] < max(produced):
                out.append(x["end"] - max(produced))
    return out


def measure_overheads(spans: dict[int, list[dict]], ranks: Sequence[RankCosts], slot: int) -> Overheads:
    """:class:`Overheads` from one step's per-rank trace spans (``name``, ``mb``, ``start``,
    ``end`` in ms on a shared clock) and the emulated times the ranks waited for in that step.

    * ``op_ms``: per rank, (forward + backward + send + load span time - emulated time) per op;
      the median over ranks;
    * ``comm_ms``: the median of :func:`crossing_latencies`;
    * ``prep``: on, so ranks start after their own recorded data preparation;
    * ``tail_ms``: per stage, the smallest (last span end - last backward end) of its ranks: the
      replica that reached the gradient all-reduce last did not wait in it.
    """
    ranks = talkers(ranks)
    spans = {r.rank: spans[r.rank] for r in ranks if r.rank in spans}
    by_rank = {r.rank: r for r in ranks}
    per_op, tails = [], {}
    for rank, sp in spans.items():
        rc = by_rank[rank]
        ops = [x for x in sp if x["name"] in ("forward", "backward")]
        if not ops:
            continue
        busy = sum(x["end"] - x["start"] for x in sp if x["name"] in ("forward", "backward", "send", "load"))
        emulated = sum(rc.fwd_ms) + (sum(rc.bwd_ms) if any(x["name"] == "backward" for x in ops) else 0.0)
        per_op.append((busy - emulated) / len(ops))
        tails.setdefault(rc.global_stage, []).append(max(x["end"] for x in sp) - max(x["end"] for x in ops))
    latency = crossing_latencies(spans, ranks, slot)
    stages = 1 + max(r.global_stage for r in ranks)
    return Overheads(float(np.median(per_op)) if per_op else 0.0,
                     max(0.0, float(np.median(latency))) if latency else 0.0,
                     tuple(float(min(tails.get(g, [0.0]))) for g in range(stages)), prep=True)


def measured_costs(spans: dict[int, list[dict]], ranks: Sequence[RankCosts]) -> list[RankCosts]:
    """``ranks`` with every op's time replaced by what it took in the trace: a forward with the
    ``load`` before it, a backward, each with the ``send`` after it (the spans ``op_ms`` counts).
    On a loaded machine an op takes longer than its emulated time (its real layers, or the wake-up
    from its wait, lose the core); the simulator fed these times, with ``op_ms`` 0, replays the
    ops as they ran. A rank without backward spans keeps its zero backward times."""
    out = []
    for r in ranks:
        k = len(r.fwd_ms)
        took = {"forward": [0.0] * k, "backward": [0.0] * k}
        last = "forward"
        for x in spans.get(r.rank, []):
            name, mb, dur = x["name"], x["mb"], x["end"] - x["start"]
            if name in took:
                last = name
            elif name == "load":
                name = "forward"
            elif name == "send":
                name = last
            else:
                continue
            if isinstance(mb, int) and 0 <= mb < k:
                took[name][mb] += dur
        bwd = tuple(t if b > 0 else 0.0 for t, b in zip(took["backward"], r.bwd_ms))
        out.append(replace(r, fwd_ms=tuple(took["forward"]), bwd_ms=bwd))
    return out


def read_trace(path: str | os.PathLike) -> list[dict]:
    """One rank's spans from ``<run>/trace/rank<r>.json`` as ``name``/``mb``/``start``/``end`` (ms)."""
    events = read_trace_events(path)
    return [{"name": e["name"], "mb": (e.get("args") or {}).get("microbatch"),
             "start": e["ts"] / 1e3, "end": (e["ts"] + e["dur"]) / 1e3}
            for e in events if e.get("ph") == "X"]


def load_records(directory: str | os.PathLike) -> dict[int, list[RankCosts]]:
    """Step (1-based) -> every rank's ``RankCosts``, from the files ``Emulator.save`` wrote."""
    files = sorted(Path(directory).glob("rank*.json"))
    if not files:
        raise FileNotFoundError(f"{directory}: no emulate/rank*.json (was emulate.enabled set?)")
    out: dict[int, list[RankCosts]] = {}
    for f in files:
        d = json.loads(f.read_text())
        for s in d["steps"]:
            out.setdefault(s["step"], []).append(
                RankCosts(d["rank"], d["module"], d["global_stage"], d["dp"], tuple(s["fwd_ms"]),
                          tuple(s["bwd_ms"]), 1e3 * s["prep_s"],
                          {m: tuple(map(tuple, per)) for m, per in s.get("peers", {}).items()}))
    return out


def wait_summary(directory: str | os.PathLike) -> dict[str, float]:
    """Totals over ranks and steps: seconds waited, ops whose real compute overran, their excess."""
    tot = {"waited_s": 0.0, "overruns": 0.0, "overrun_s": 0.0}
    for f in sorted(Path(directory).glob("rank*.json")):
        for s in json.loads(f.read_text())["steps"]:
            for k in tot:
                tot[k] += s[k]
    return tot

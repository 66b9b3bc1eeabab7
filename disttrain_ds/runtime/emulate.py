"""Emulated compute (recipe section ``emulate``): the real runtime with modelled kernel times.

Everything a training step does stays real -- processes, rank groups, the inter-engine
communicator, DeepSpeed's P2P, the 1F1B schedule, reordering, data producers, optimizer steps --
and the (tiny) layers still run so real tensors cross every boundary. Only the duration of each
forward and backward pass is dictated: once the real layers are done, the op waits (sleeps)
until the emulated time since its start has passed. On a small CPU host many ranks can then
"compute" at once, since a sleeping rank needs no core.

Emulated time of one op, for the rank of ``module`` at pipeline stage ``s`` of ``pp``, TP ``tp``,
and the samples of its DP block in microbatch ``g``::

    forward  = ms_per_flop(module, tp) * sum(cost model forward FLOPs of those samples) / pp
    backward = BACKWARD_FACTOR * forward

``ms_per_flop`` comes from a planner profile -- the module's mean per-sample fwd+bwd time
``cost_ms[tp]`` describes the mean sample of the recipe's data (``calibration_batches`` global
batches from step 0) -- or, without a profile, from ``emulate.tflops``. Either way it is
multiplied by ``emulate.time_scale``. Per-sample variation is the recipe's cost model
(``runtime.setup.cost_model``, the one reordering and the balance metrics use).

The pure functions here are shared by the engine hook and by the simulator side of
``bench/emulated.py``, so the simulator is fed exactly the times the ranks wait for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..configtools import ConfigError
from ..comm.routes import blocks
from ..planner.simulate import BWD, FWD, SimResult, simulate_1f1b, stage_order
from ..topology import MODULES, Topology

BACKWARD_FACTOR = 2.0
"""Backward time as a multiple of forward (trained module, no recomputation; as the planner's
paper-scale profiles assume)."""


# --------------------------------------------------------------------------- recipe checks


def module_tp(topo: Topology) -> dict[str, int]:
    """TP degree of each module's ranks (monolithic: the LLM's, as ``Topology`` lays it out)."""
    return {m.name: m.tp for m in topo.modules}


def check_emulate(recipe, src: str) -> None:
    """One-line ``ConfigError`` for an ``emulate`` section that cannot run."""
    from ..config import resolve_path
    from ..planner.profile import load_profile

    e = recipe.emulate
    if recipe.layout == "reference":
        raise ConfigError(f"{src}: 'emulate.enabled' needs layout monolithic or disaggregated "
                          "(the reference layout computes for real)")
    if not e.profile:
        if not e.tflops > 0:
            raise ConfigError(f"{src}: 'emulate.tflops' must be > 0 when 'emulate.profile' is empty, "
                              f"got {e.tflops}")
        return
    path = resolve_path(e.profile)
    if not path.is_file():
        raise ConfigError(f"{src}: 'emulate.profile' {e.profile} is not a file")
    profile = load_profile(path)  # ProfileError (a ConfigError) names the field and the file
    for name, tp in module_tp(Topology.from_recipe(recipe)).items():
        if tp not in profile.modules[name].cost_ms:
            raise ConfigError(f"{src}: 'emulate.profile' {e.profile} has no modules.{name}.cost_ms "
                              f"for tp={tp}")


# --------------------------------------------------------------------------- pure cost functions


def ms_per_flop_from_profile(cost_ms: float, mean_fwd_flops: float, time_scale: float,
                             backward_factor: float = BACKWARD_FACTOR) -> float:
    """Forward ms per forward FLOP such that the mean sample (``mean_fwd_flops``) takes the
    profile's fwd+bwd ``cost_ms`` times ``time_scale``. A module with no work in the data
    (mean 0) costs nothing."""
    if mean_fwd_flops <= 0:
        return 0.0
    return time_scale * cost_ms / (1.0 + backward_factor) / mean_fwd_flops


def ms_per_flop_from_tflops(tflops: float, tp: int, time_scale: float) -> float:
    """Forward ms per forward FLOP at ``tflops`` sustained per GPU, work split over ``tp`` GPUs."""
    if not tflops > 0:
        raise ValueError(f"tflops must be > 0, got {tflops}")
    return time_scale * 1e3 / (tflops * 1e12) / tp


def microbatch_ms(fwd_flops: Sequence[float], ms_per_flop: float, pp: int,
                  backward_factor: float = BACKWARD_FACTOR) -> tuple[float, float]:
    """(forward ms, backward ms) of one stage for one microbatch: the stage's 1/pp share of its
    replica's samples (``fwd_flops``, cost-model forward FLOPs each)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    fwd = ms_per_flop * float(np.sum(fwd_flops, dtype=np.float64)) / pp
    return fwd, fwd * backward_factor


def mean_module_flops(flops: np.ndarray) -> dict[str, float]:
    """Mean forward FLOPs per sample of each module from ``[n, 3]`` cost-model costs."""
    f = np.asarray(flops, dtype=np.float64).reshape(-1, 3)
    if len(f) == 0:
        raise ValueError("need at least one sample")
    return {name: float(v) for name, v in zip(MODULES, f.mean(axis=0))}


def module_rates(emulate, topo: Topology, mean_flops: dict[str, float] | None,
                 profile=None) -> dict[str, float]:
    """Forward ms per forward FLOP of every module's ranks (``emulate``: the recipe section)."""
    tps = module_tp(topo)
    if profile is None:
        return {n: ms_per_flop_from_tflops(emulate.tflops, tps[n], emulate.time_scale) for n in MODULES}
    if mean_flops is None:
        raise ValueError("a profile needs the data's mean FLOPs per module")
    return {n: ms_per_flop_from_profile(profile.modules[n].cost_ms[tps[n]], mean_flops[n],
                                        emulate.time_scale) for n in MODULES}


@dataclass(frozen=True)
class RankCosts:
    """Emulated op times of one rank for one step (what it waited for)."""

    rank: int
    """Global rank."""
    module: str
    """encoder | llm | generator."""
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


def links(ranks: Sequence[RankCosts], slot: int) -> dict[tuple[int, int], list[int]]:
    """``(rank, FWD)`` -> ranks whose forward output it receives; ``(rank, BWD)`` -> ranks whose
    input gradient it receives. Inside a module: the same replica's neighbouring stage; across a
    module boundary: every replica whose DP block of the ``slot`` samples overlaps its own."""
    stages = {r.global_stage for r in ranks}
    reps = {g: len({r.dp for r in ranks if r.global_stage == g}) for g in stages}

    def feeds(u: RankCosts, d: RankCosts) -> bool:  # u (stage g) sends activations to d (stage g + 1)
        if u.module == d.module:
            return u.dp == d.dp
        bu, bd = blocks(slot, reps[u.global_stage])[u.dp], blocks(slot, reps[d.global_stage])[d.dp]
        return bu.start < bd.stop and bd.start < bu.stop

    return {(r.rank, kind): [x.rank for x in ranks if x.global_stage == r.global_stage + (1 if kind else -1)
                             and (feeds(r, x) if kind else feeds(x, r))] for r in ranks for kind in (FWD, BWD)}


def simulate_ranks(ranks: Sequence[RankCosts], slot: int,
                   overheads: Overheads = Overheads()) -> tuple[float, list[dict]]:
    """Like :func:`simulate_step`, with every rank its own timeline instead of lock-step
    replicas: each rank runs its stage's 1F1B op order (``stage_order``), an op starting once
    the rank is free (with ``prep``: no earlier than its data preparation) and the ranks it
    receives from (:func:`links`) have produced that microbatch plus ``comm_ms``. Returns the
    time and every op as a timeline event."""
    k, p, o = len(ranks[0].fwd_ms), 1 + max(r.global_stage for r in ranks), overheads
    deps, tails = links(ranks, slot), o.tail_ms or (0.0,) * p
    todo = {r.rank: stage_order(k, p, r.global_stage) for r in ranks}
    free, done, events = {r.rank: r.prep_ms if o.prep else 0.0 for r in ranks}, {}, []
    while any(todo.values()):
        progressed = False
        for r in ranks:
            while todo[r.rank]:
                kind, i = todo[r.rank][0]
                srcs = deps[(r.rank, kind)]
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


def measure_overheads(spans: dict[int, list[dict]], ranks: Sequence[RankCosts], slot: int) -> Overheads:
    """:class:`Overheads` from one step's per-rank trace spans (``name``, ``mb``, ``start``,
    ``end`` in ms on a shared clock) and the emulated times the ranks waited for in that step.

    * ``op_ms``: per rank, (forward + backward + send + load span time - emulated time) per op;
      the median over ranks;
    * ``comm_ms``: for receives posted before their data was produced (the receiver waited),
      receive end - the latest end of the producing ops (:func:`links`); the median;
    * ``prep``: on, so ranks start after their own recorded data preparation;
    * ``tail_ms``: per stage, the smallest (last span end - last backward end) of its ranks: the
      replica that reached the gradient all-reduce last did not wait in it.
    """
    by_rank, deps = {r.rank: r for r in ranks}, links(ranks, slot)
    ends = {(rank, x["name"], x["mb"]): x["end"] for rank, sp in spans.items() for x in sp
            if x["name"] in ("forward", "backward")}
    per_op, latency, tails = [], [], {}
    for rank, sp in spans.items():
        rc = by_rank[rank]
        ops = [x for x in sp if x["name"] in ("forward", "backward")]
        if not ops:
            continue
        busy = sum(x["end"] - x["start"] for x in sp if x["name"] in ("forward", "backward", "send", "load"))
        emulated = sum(rc.fwd_ms) + (sum(rc.bwd_ms) if any(x["name"] == "backward" for x in ops) else 0.0)
        per_op.append((busy - emulated) / len(ops))
        tails.setdefault(rc.global_stage, []).append(max(x["end"] for x in sp) - max(x["end"] for x in ops))
        for i, x in enumerate(sp):
            nxt = next((y for y in sp[i + 1:] if y["name"] in ("forward", "backward") and y["mb"] == x["mb"]), None)
            if x["name"] != "recv" or nxt is None:
                continue
            kind = FWD if nxt["name"] == "forward" else BWD
            produced = [ends.get((u, nxt["name"], x["mb"])) for u in deps[(rank, kind)]]
            if produced and None not in produced and x["start"] < max(produced):
                latency.append(x["end"] - max(produced))
    stages = 1 + max(r.global_stage for r in ranks)
    return Overheads(float(np.median(per_op)) if per_op else 0.0,
                     max(0.0, float(np.median(latency))) if latency else 0.0,
                     tuple(float(min(tails.get(g, [0.0]))) for g in range(stages)), prep=True)


def read_trace(path: str | os.PathLike) -> list[dict]:
    """One rank's spans from ``<run>/trace/rank<r>.json`` as ``name``/``mb``/``start``/``end`` (ms)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [{"name": e["name"], "mb": (e.get("args") or {}).get("microbatch"),
             "start": e["ts"] / 1e3, "end": (e["ts"] + e["dur"]) / 1e3}
            for e in events if e.get("ph") == "X"]


# --------------------------------------------------------------------------- waiting


def wait_until(deadline: float) -> float:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``; returns the seconds slept
    (negative: the deadline had already passed by that much)."""
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
    return remaining


# --------------------------------------------------------------------------- the runtime side


def calibration_flops(recipe) -> np.ndarray:
    """``[n, 3]`` cost-model forward FLOPs of the first ``emulate.calibration_batches`` global
    batches of the recipe's data (in-process, unreordered: the same samples in any setting)."""
    from .setup import build_data_and_spec, cost_model

    plain = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, producers=0, reorder=False))
    source, spec = build_data_and_spec(plain)
    try:
        patch = recipe.model.encoder.patch_size
        stats = [s.stats(patch, spec.special) for b in range(recipe.emulate.calibration_batches)
                 for s in source.global_batch(b)]
    finally:
        source.close()
    return cost_model(recipe).costs(stats)


def recipe_rates(recipe, topo: Topology) -> dict[str, float]:
    """``module_rates`` of a recipe (loads its profile and calibration data)."""
    from ..config import resolve_path
    from ..planner.profile import load_profile

    e = recipe.emulate
    if not e.profile:
        return module_rates(e, topo, None)
    profile = load_profile(resolve_path(e.profile))
    return module_rates(e, topo, mean_module_flops(calibration_flops(recipe)), profile)


class Emulator:
    """One rank's emulated compute: op times of the current step, the waits, and a record."""

    def __init__(self, module: str, global_stage: int, dp: int, pp: int, ms_per_flop: float,
                 backward: bool, cost_model, patch_size: int, special):
        self.module, self.global_stage, self.dp, self.pp = module, global_stage, dp, pp
        self.ms_per_flop, self.backward = ms_per_flop, backward
        self.cost_model, self.patch_size, self.special = cost_model, patch_size, special
        self.fwd_ms: list[float] = []
        self.bwd_ms: list[float] = []
        self.steps: list[dict] = []

    @classmethod
    def for_rank(cls, recipe, topo: Topology, rank: int, spec, backward: bool) -> "Emulator":
        from .setup import cost_model

        grid = topo.module_of(rank)
        stage, dp, _ = grid.coords(rank)
        rate = recipe_rates(recipe, topo)[grid.name]
        return cls(grid.name, topo.stage_offset(grid.name) + stage, dp, grid.pp, rate, backward,
                   cost_model(recipe), recipe.model.encoder.patch_size, spec.special)

    def set_step(self, step: int, blocks: Sequence[Sequence], started: float | None = None) -> None:
        """This rank's samples of each microbatch of ``step`` (``PackedSample`` lists);
        ``started``: ``perf_counter()`` at the step's start (records the data preparation time)."""
        prep = 0.0 if started is None else time.perf_counter() - started
        self.fwd_ms, self.bwd_ms = [], []
        for block in blocks:
            flops = [self.cost_model.module_cost(self.module, s.stats(self.patch_size, self.special))
                     for s in block]
            f, b = microbatch_ms(flops, self.ms_per_flop, self.pp)
            self.fwd_ms.append(f)
            self.bwd_ms.append(b if self.backward else 0.0)
        self.steps.append({"step": step + 1, "fwd_ms": list(self.fwd_ms), "bwd_ms": list(self.bwd_ms),
                           "prep_s": prep, "waited_s": 0.0, "overruns": 0, "overrun_s": 0.0})

    def wait(self, kind: str, mb: int, t0: float) -> None:
        """Hold the op that started at ``t0`` until its emulated time has passed."""
        target = (self.fwd_ms if kind == "fwd" else self.bwd_ms)[mb] / 1e3
        left = wait_until(t0 + target)
        rec = self.steps[-1]
        if left > 0:
            rec["waited_s"] += left
        else:  # the real layers took longer than the emulated time
            rec["overruns"] += 1
            rec["overrun_s"] += -left

    def save(self, directory: str | os.PathLike, rank: int) -> Path:
        """``<directory>/rank<r>.json``: module, stage, replica, rate and every step's times."""
        path = Path(directory) / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "rank": rank, "module": self.module, "global_stage": self.global_stage, "dp": self.dp,
            "pp": self.pp, "ms_per_flop": self.ms_per_flop, "steps": self.steps}))
        return path


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
                          tuple(s["bwd_ms"]), 1e3 * s["prep_s"]))
    return out


def wait_summary(directory: str | os.PathLike) -> dict[str, float]:
    """Totals over ranks and steps: seconds waited, ops whose real compute overran, their excess."""
    tot = {"waited_s": 0.0, "overruns": 0.0, "overrun_s": 0.0}
    for f in sorted(Path(directory).glob("rank*.json")):
        for s in json.loads(f.read_text())["steps"]:
            for k in tot:
                tot[k] += s[k]
    return tot

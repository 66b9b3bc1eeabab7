"""Emulated compute (recipe section ``emulate``): the real runtime with modelled kernel times.

Everything a training step does stays real -- processes, rank groups, the inter-engine
communicator, DeepSpeed's P2P, the 1F1B schedule, reordering, data producers, optimizer steps --
and the (tiny) layers still run so real tensors cross every boundary. Only the duration of each
forward and backward pass is dictated: once the real layers are done, the op waits (sleeps)
until the emulated time since its start has passed. On a small CPU host many ranks can then
"compute" at once, since a sleeping rank needs no core.

Any module graph the runtime trains is emulated (encoders -> LLM -> generators, named as the
recipe names them). Emulated time of one op, for the rank of ``module`` at pipeline stage ``s``
of ``pp``, TP ``tp``, and the samples of its DP block in microbatch ``g``::

    forward  = ms_per_flop(module, tp) * sum(cost model forward FLOPs of those samples) / pp
    backward = BACKWARD_FACTOR * forward

``ms_per_flop`` comes from a planner profile -- the module's mean per-sample fwd+bwd time
``cost_ms[tp]`` describes the mean sample of the recipe's data (``calibration_batches`` global
batches from step 0) -- or, without a profile, from ``emulate.tflops``. Either way it is
multiplied by ``emulate.time_scale``. Per-sample variation is the recipe's cost model
(``runtime.setup.cost_model``, the one reordering and the balance metrics use), by module name:
an image encoder costs its input images at its own patch size, an audio encoder its input clips,
the LLM its packed sequence, a generator its generated images.

The pure functions here are shared by the engine hook and by the simulator side
(``schedule/replay.py``, ``bench/emulated.py``), so the simulator is fed exactly the times the
ranks wait for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from disttrain_ds.cost.backward import BACKWARD_FACTOR
from disttrain_ds.cost.graph_costs import unit_costs
from disttrain_ds.cost.profile_file import load_profile
from disttrain_ds.families import default_config
from disttrain_ds.recipe.graph import graph_of, module_config
from disttrain_ds.recipe.schema import resolve_path
from disttrain_ds.runtime.guards import fresh_path
from disttrain_ds.topology import Topology

# --------------------------------------------------------------------------- recipe checks


def module_tp(topo: Topology) -> dict[str, int]:
    """TP degree of each module's ranks (monolithic: the LLM's, as ``Topology`` lays it out)."""
    return {m.name: m.tp for m in topo.modules}


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


def mean_module_flops(flops: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean forward FLOPs per sample of each module from its per-sample cost-model costs."""
    out = {}
    for name, f in flops.items():
        if len(f) == 0:
            raise ValueError("need at least one sample")
        out[name] = float(np.mean(np.asarray(f, dtype=np.float64)))
    return out


def module_rates(emulate, topo: Topology, mean_flops: dict[str, float] | None,
                 profile=None) -> dict[str, float]:
    """Forward ms per forward FLOP of every module's ranks (``emulate``: the recipe section)."""
    tps = module_tp(topo)
    if profile is None:
        return {n: ms_per_flop_from_tflops(emulate.tflops, tp, emulate.time_scale) for n, tp in tps.items()}
    if mean_flops is None:
        raise ValueError("a profile needs the data's mean FLOPs per module")
    return {n: ms_per_flop_from_profile(profile.modules[n].cost_ms[tp], mean_flops[n], emulate.time_scale)
            for n, tp in tps.items()}


# --------------------------------------------------------------------------- waiting


def wait_until(deadline: float) -> float:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``; returns the seconds slept
    (negative: the deadline had already passed by that much)."""
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
    return remaining


# --------------------------------------------------------------------------- the runtime side


def patch_size(recipe, name: str) -> int:
    """The patch size a sample's image statistics are taken at for module ``name``: an
    encoder's own; any other module's cost does not depend on it (the default encoder's)."""
    return getattr(module_config(recipe, name), "patch_size", None) or default_config("encoder").patch_size


def sample_flops(cost_model, name: str, sample, patch: int, special) -> float:
    """Cost-model forward FLOPs of one ``PackedSample`` in module ``name`` (``cost_model``: a
    ``cost.graph_costs.GraphCosts``)."""
    return cost_model.module_cost(name, sample.stats(patch, special))


def calibration_flops(recipe) -> dict[str, np.ndarray]:
    """Per module name, the cost-model forward FLOPs of each sample of the first
    ``emulate.calibration_batches`` global batches of the recipe's data."""
    return data_flops(recipe, recipe.emulate.calibration_batches * recipe.train.global_batch)


def data_flops(recipe, samples: int) -> dict[str, np.ndarray]:
    """Per module name, the cost-model forward FLOPs of each of the first ``samples`` samples of the
    recipe's data, global batch by global batch from step 0 (in-process, unreordered: the same
    samples in any setting)."""
    return data_work(recipe, samples)[0]


def data_work(recipe, samples: int) -> tuple[dict[str, np.ndarray], dict[str, list[list[float]]]]:
    """``data_flops``, and per encoder and generator the forward FLOPs of each of those samples'
    units (images or audio clips, target images), each priced on its own."""
    # deferred: loads torch (safetensors too)
    from disttrain_ds.runtime.setup import build_data_and_spec, cost_model

    plain = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, producers=0, reorder=False))
    source, spec = build_data_and_spec(plain)
    try:
        batches = -(-samples // recipe.train.global_batch)
        read = [s for b in range(batches) for s in source.global_batch(b)][:samples]
    finally:
        source.close()
    cm, graph = cost_model(recipe), graph_of(recipe)
    flops = {n: np.array([sample_flops(cm, n, s, patch_size(recipe, n), spec.special)
                          for s in read], dtype=np.float64) for n in graph.names}
    units = {n: [unit_costs(spec, cm, n, s) for s in read] for n in graph.names if n != graph.llm}
    return flops, units


def recipe_rates(recipe, topo: Topology) -> dict[str, float]:
    """``module_rates`` of a recipe (loads its profile and calibration data)."""
    e = recipe.emulate
    if not e.profile:
        return module_rates(e, topo, None)
    profile = load_profile(resolve_path(e.profile, recipe.source_file))
    return module_rates(e, topo, mean_module_flops(calibration_flops(recipe)), profile)


class Emulator:
    """One rank's emulated compute: op times of the current step, the waits, and a record."""

    def __init__(self, module: str, global_stage: int, dp: int, pp: int, ms_per_flop: float,
                 backward: bool, cost_model, patch_size: int, special, role: str | None = None,
                 sp: int = 1, sp_cost=None, sp_tokens=None):
        """``sp``, ``sp_cost``, ``sp_tokens``: the module's SP degree, how its all-to-alls are priced
        (``reorder/sp_groups.py::SPCost``) and the tokens of a sample they carry (the LLM's sequence,
        an encoder's item rows): each rank computes 1/sp of the work, then exchanges."""
        self.module, self.global_stage, self.dp, self.pp = module, global_stage, dp, pp
        self.sp, self.sp_cost, self.sp_tokens = sp, sp_cost, sp_tokens
        self.role = role or module  # the three-module graph names its modules after their roles
        self.ms_per_flop, self.backward = ms_per_flop, backward
        self.cost_model, self.patch_size, self.special = cost_model, patch_size, special
        self.fwd_ms: list[float] = []
        self.bwd_ms: list[float] = []
        self.steps: list[dict] = []

    @classmethod
    def for_rank(cls, recipe, topo: Topology, rank: int, spec, backward: bool, per_node: int = 1) -> "Emulator":
        # deferred: loads torch (safetensors too)
        from disttrain_ds.runtime.setup import cost_model, sp_cost

        grid = topo.module_of(rank)
        stage, dp, _ = grid.coords(rank)
        rate = recipe_rates(recipe, topo)[grid.name]
        role = graph_of(recipe).role(grid.name)
        if role == "llm":
            tokens = lambda s: int(s.input_ids.shape[0])  # noqa: E731
        else:
            tokens = lambda s: spec.item_rows(grid.name, s)  # noqa: E731
        return cls(grid.name, topo.stage_offset(grid.name) + stage, dp, grid.pp, rate, backward,
                   cost_model(recipe), patch_size(recipe, grid.name), spec.special, role=role, sp=grid.sp,
                   sp_cost=sp_cost(recipe, spec, grid.name, per_node) if grid.sp > 1 else None, sp_tokens=tokens)

    def set_step(self, step: int, blocks: Sequence[Sequence], started: float | None = None,
                 peers: dict[str, list[list[int]]] | None = None) -> None:
        """This rank's samples of each microbatch of ``step`` (``PackedSample`` lists);
        ``started``: ``perf_counter()`` at the step's start (records the data preparation time);
        ``peers``: per module across a boundary, per microbatch, the replicas this rank exchanges
        units with (recorded for the simulator: ``schedule/replay.py::RankCosts.peers``)."""
        prep = 0.0 if started is None else time.perf_counter() - started
        self.fwd_ms, self.bwd_ms = [], []
        for block in blocks:
            flops = [sample_flops(self.cost_model, self.module, s, self.patch_size, self.special) for s in block]
            f, b = microbatch_ms(flops, self.ms_per_flop, self.pp)
            if self.sp > 1:  # 1/sp of the work each, then this stage's share of the all-to-alls, half each way
                a2a = sum(self.sp_cost.a2a_ms(self.sp_tokens(s), self.sp) for s in block) / self.pp / 2
                f, b = f / self.sp + a2a, b / self.sp + a2a
            self.fwd_ms.append(f)
            self.bwd_ms.append(b if self.backward else 0.0)
        self.steps.append({"step": step + 1, "fwd_ms": list(self.fwd_ms), "bwd_ms": list(self.bwd_ms),
                           "prep_s": prep, "waited_s": 0.0, "overruns": 0, "overrun_s": 0.0, "peers": peers or {}})

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
        """``<directory>/rank<r>.json`` (``rank<r>-2.json``, ... when an earlier launch wrote one):
        module, stage, replica, rate and every step's times."""
        path = fresh_path(Path(directory) / f"rank{rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "rank": rank, "module": self.module, "role": self.role, "global_stage": self.global_stage, "dp": self.dp,
            "pp": self.pp, "ms_per_flop": self.ms_per_flop, "steps": self.steps}))
        return path

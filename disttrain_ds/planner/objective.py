"""The planner's cost model: one iteration's time and memory of a layout over a module graph.

With D = DP_llm * M samples per pipeline step and K = BS / D steps per iteration, module i running
(dp, tp, pp) handles m_i = D / dp samples per step (m = M for the LLM), so its warm-up term is
w_i = m_i * C_i(tp) and its stage time s_i = w_i / pp. Encoders run side by side before the LLM
and generators side by side after it (:class:`~disttrain_ds.graph.ModuleGraph`), so one iteration
takes the warm-up along the graph's critical path plus the slowest stage of any module per step:

    T_iter = (w_llm + (max_enc w_e + max_gen w_g)) + max_i s_i * (K - 1)

(an empty role contributes 0). For the three-module graph this is exactly
``(w_llm + (w_enc + w_gen)) + max(s_llm, s_enc, s_gen) * (K - 1)``, float for float.

C(tp) already includes the TP effect, so nothing is divided by TP again. When the profile carries
per-sample draws, w_i = (m_i * C_i(tp)) * h_i and s_i = ((m_i * C_i(tp)) * g_i) / pp, with the
straggler factors h (expected slowest replica over the mean) and g (the same over pp steps in
flight) of :mod:`disttrain_ds.planner.hetero`; without draws they are not applied at all. ``combine`` forms the
sum for numbers and ``combine_arrays`` for numpy columns with the same float operations in the
same order (max is exact, so only the additions' order matters), which is what lets the search
and ``exhaustive_plan`` agree bit for bit.
"""

from __future__ import annotations

from functools import reduce
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from disttrain_ds.cost import memory_model as mm
from disttrain_ds.cost.profile import AUTO_SP, ModuleProfile, Profile
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.hetero import StragglerTable


class Degrees(NamedTuple):
    """Parallel degrees of one module; it occupies dp * tp * pp * sp GPUs (``sp`` = ``AUTO_SP``:
    adaptive groups over the dp replicas, dp * tp * pp GPUs)."""

    dp: int
    tp: int
    pp: int
    sp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * max(self.sp, 1)

    @property
    def block(self) -> int:
        """Consecutive ranks of one replica's stage (its TP x SP groups): where a node boundary must not fall."""
        return self.tp * max(self.sp, 1)


AUTO_KEY = 1023
"""Where ``AUTO_SP`` sorts among SP degrees when plans tie: after every fixed degree."""


def sp_key(sp: Any) -> Any:
    """The SP degree's place in the tie-break order (``layout_key``; numbers or numpy arrays)."""
    return np.where(np.asarray(sp) == AUTO_SP, AUTO_KEY, sp) if isinstance(sp, np.ndarray) else (
        AUTO_KEY if sp == AUTO_SP else sp)


class IterTime(NamedTuple):
    """Predicted time of one training iteration, in milliseconds."""

    warmup_ms: float
    steady_ms: float
    total_ms: float


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def combine(graph: ModuleGraph, warm: Mapping[str, float], stage: Mapping[str, float],
            microbatches: int) -> IterTime:
    """T_iter from every module's warm-up term and stage time (the canonical float order)."""
    w = graph.critical_path(warm)
    steady = max(stage[n] for n in graph.names) * (microbatches - 1)
    return IterTime(w, steady, w + steady)


class Roles(NamedTuple):
    """A graph's modules by role, looked up once: the search forms T_iter thousands of times."""

    llm: str
    encoders: tuple[str, ...]
    generators: tuple[str, ...]
    names: tuple[str, ...]

    @staticmethod
    def of(graph: ModuleGraph) -> "Roles":
        return Roles(graph.llm, graph.encoders, graph.generators, graph.names)


def _fold_max(values: Sequence[Any], default: Any) -> Any:
    return reduce(np.maximum, values) if values else default


def combine_arrays(graph: ModuleGraph | Roles, warm: Mapping[str, Any],
                   stage: Mapping[str, Any], microbatches: int) -> Any:
    """``combine(...).total_ms`` for numpy columns (broadcast against each other), elementwise
    with the same float operations; a module may also be a plain number."""
    enc = _fold_max([warm[n] for n in graph.encoders], 0.0)
    gen = _fold_max([warm[n] for n in graph.generators], 0.0)
    steady = _fold_max([stage[n] for n in graph.names], 0.0) * (microbatches - 1)
    return (warm[graph.llm] + (enc + gen)) + steady


def samples_per_step(profile: Profile, name: str, d: int, dp: int) -> int:
    """Samples one replica of module ``name`` takes per pipeline step: M for the LLM, D / dp for
    every other module."""
    return profile.microbatch if name == profile.graph.llm else d // dp


def straggler_table(profile: Profile) -> StragglerTable | None:
    """The profile's straggler factors, or None when it has no per-sample draws."""
    return StragglerTable(profile) if profile.has_draw else None


def module_terms(profile: Profile, name: str, deg: Degrees, m: int,
                 table: StragglerTable | None) -> tuple[float, float]:
    """(warm-up term, stage time) of module ``name`` at ``deg`` taking ``m`` samples per replica
    per step: m * C(tp) and m * C(tp) / pp, scaled by the straggler factors h and g of
    ``table`` (:mod:`disttrain_ds.planner.hetero`) when given."""
    w = m * profile.modules[name].cost(deg.tp, deg.sp)
    if table is None:
        return w, w / deg.pp
    if deg.sp == AUTO_SP:  # adaptive groups: their own factors (``hetero.py``)
        return (w * table.auto_factor(name, deg.dp, m, 1, deg.tp),
                (w * table.auto_factor(name, deg.dp, m, deg.pp, deg.tp)) / deg.pp)
    return w * table.factor(name, deg.dp, m), (w * table.factor(name, deg.dp, m, deg.pp)) / deg.pp


def t_iter(profile: Profile, layout: Mapping[str, Degrees],
           table: StragglerTable | None = None) -> IterTime:
    """Predicted iteration time of ``layout`` (module name -> Degrees); pure, no feasibility
    checks beyond the divisibility the formula needs. ``table``: the profile's straggler factors
    (``straggler_table``); None prices every sample at the mean cost."""
    graph = profile.graph
    d = layout[graph.llm].dp * profile.microbatch
    if profile.global_batch % d or any(d % layout[n].dp for n in graph.names):
        raise ValueError(f"layout {dict(layout)} does not divide global batch {profile.global_batch}")
    w, s = {}, {}
    for n in graph.names:
        deg = layout[n]
        w[n], s[n] = module_terms(profile, n, deg, samples_per_step(profile, n, d, deg.dp), table)
    return combine(graph, w, s, profile.global_batch // d)


def memory_bytes(spec: ModuleProfile, dp: Any, tp: Any, pp: Any, m: Any, to_end: Any,
                 microbatches: Any, sp: Any = 1) -> Any:
    """``memory_per_gpu`` for Python ints and numpy arrays alike (identical floats), by the shared
    per-rank formula of :mod:`disttrain_ds.cost.memory_model`; ``to_end``: global stages from
    the module's first stage to the end of the chain (``memory_model.stages_to_end``). With SP
    ``sp`` every rank keeps 1/sp of each sample's activations (counted as m / sp samples) and ZeRO
    shards the optimizer over the dp x sp ranks of the data axis."""
    per_param = (spec.weight_bytes_per_param, 0.0, 0.0) if spec.frozen else (
        spec.weight_bytes_per_param, spec.grad_bytes_per_param, spec.optimizer_bytes_per_param)
    sp = np.maximum(sp, 1)  # adaptive groups (AUTO_SP) keep what SP 1 keeps: the runtime checks them so
    opt_dp = dp * sp if spec.optimizer_sharded else 1
    m = m / sp if np.any(np.asarray(sp) != 1) else m
    refused = 0.0
    for r_dp, r_tp, r_pp in spec.refused:  # what the runtime's check refused never fits
        refused = np.where((dp == r_dp) & (tp == r_tp) & (pp == r_pp), np.inf, refused)
    if spec.stages is not None:  # the runtime's own stages (``planner/recipe_memory.py``)
        return mm.worst_stage_bytes(spec.stages, tp, pp, per_param, opt_dp, m, to_end, microbatches,
                                    spec.reduce_bucket_bytes) + spec.extra_bytes_per_rank + refused
    act = spec.activation_bytes_per_sample
    shard = spec.activation_tp_sharded
    every = spec.activation_checkpointing
    if every <= 0:
        kept = mm.tp_share(act * (1 - shard) / pp, act * shard / pp, tp)
        workspace = 0.0
    else:  # checkpointed blocks of ``every`` layers: each keeps its input (replicated over TP);
        # backward recomputes one block of one microbatch at a time
        stage_layers = spec.layers // pp
        kept = -(-stage_layers // every) * spec.layer_output_bytes_per_sample
        block = np.minimum(every, stage_layers) * (act / spec.layers)
        workspace = mm.tp_share(block * (1 - shard), block * shard, tp)
    return mm.rank_bytes(spec.params / pp, tp, per_param, opt_dp, kept, workspace, m,
                         mm.in_flight(to_end, microbatches), spec.reduce_bucket_bytes) \
        + spec.extra_bytes_per_rank + refused


def memory_per_gpu(spec: ModuleProfile, degrees: Degrees, *, samples_per_microbatch: int,
                   stages_to_end: int, microbatches: int) -> float:
    """Bytes on a GPU of the module's most loaded pipeline stage: weights and gradients of its
    share of the module over tp, optimizer states further sharded over dp, and activations of the
    microbatches 1F1B keeps in flight there (``memory_model.in_flight`` of ``stages_to_end``, less
    one per stage further down), the TP-sharded part of them over TP; with
    ``activation_checkpointing``, one layer output per block and microbatch in flight plus one
    block's activations while it is recomputed; plus ``extra_bytes_per_rank``. Stages are the
    runtime's when the profile carries them (``ModuleProfile.stages``), else even: 1/pp of the
    parameters and activations each, the first stage (the most in flight) the most loaded."""
    return float(memory_bytes(spec, degrees.dp, degrees.tp, degrees.pp, samples_per_microbatch,
                              stages_to_end, microbatches, degrees.sp))


def module_stages_to_end(graph: ModuleGraph, name: str, layout: Mapping[str, Degrees]) -> int:
    """Global stages from the first stage of module ``name`` to the end of the chain in ``layout``
    (``memory_model.stages_to_end``)."""
    gen = max((layout[g].pp for g in graph.generators), default=0)
    return int(mm.stages_to_end(graph.role(name), layout[name].pp, layout[graph.llm].pp, gen))


def module_in_flight(graph: ModuleGraph, name: str, layout: Mapping[str, Degrees],
                     microbatches: int) -> int:
    """Microbatches in flight at the first stage of module ``name`` in ``layout`` (1F1B over the
    whole chain, ``memory_model.stages_to_end``)."""
    return int(mm.in_flight(module_stages_to_end(graph, name, layout), microbatches))


def layout_memory(profile: Profile, layout: Mapping[str, Degrees]) -> dict[str, float]:
    """Peak bytes per GPU of every module's most loaded stage in ``layout`` (``memory_per_gpu``)."""
    graph = profile.graph
    d = layout[graph.llm].dp * profile.microbatch
    k = profile.global_batch // d
    return {n: memory_per_gpu(profile.modules[n], layout[n],
                              samples_per_microbatch=samples_per_step(profile, n, d, layout[n].dp),
                              stages_to_end=module_stages_to_end(graph, n, layout), microbatches=k)
            for n in graph.names}


def layout_key(total_ms: float, layout: Mapping[str, Degrees], names: Sequence[str]) -> tuple:
    """Ordering of plans: faster, then fewer GPUs, then smaller (tp, sp, pp, dp) of each module in
    ``names`` order (the graph's data-flow order)."""
    gpus = sum(d.gpus for d in layout.values())
    return (total_ms, gpus) + tuple(x for n in names for x in (layout[n].tp, sp_key(layout[n].sp), layout[n].pp,
                                                               layout[n].dp))

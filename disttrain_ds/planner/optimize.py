"""Exact orchestration optimizer: per-module (DP, TP, PP) minimising one iteration's time.

With D = DP_llm * M samples per pipeline step and K = BS / D steps per iteration, module i running
(dp, tp, pp) handles m_i = D / dp samples per step (m = M for the LLM), so its warm-up term is
w_i = m_i * C_i(tp) and its stage time s_i = w_i / pp. One iteration takes

    T_iter = (w_llm + (w_enc + w_gen)) + max(s_llm, s_enc, s_gen) * (K - 1)

C(tp) already includes the TP effect, so nothing is divided by TP again. ``combine`` is the only
place this sum is formed; the search below reproduces its float operations in the same order, so
the optimizer and ``exhaustive_plan`` agree bit for bit and break ties identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import numpy as np

from disttrain_ds.planner.profile import GIB, MODULES, ModuleProfile, Profile


class PlanError(ValueError):
    """No layout satisfies the constraints; the message is one line naming the binding one."""


class Degrees(NamedTuple):
    """Parallel degrees of one module; it occupies dp * tp * pp GPUs."""

    dp: int
    tp: int
    pp: int


class IterTime(NamedTuple):
    """Predicted time of one training iteration, in milliseconds."""

    warmup_ms: float
    steady_ms: float
    total_ms: float


@dataclass(frozen=True)
class ModulePlan:
    """One module's share of a plan."""

    gpus: int
    """GPUs the module occupies."""
    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree (for Megatron's replicated stages: the GPUs sharing the work)."""
    pp: int
    """Pipeline-parallel degree."""
    samples_per_microbatch: int
    """Samples one replica processes per pipeline step."""
    warmup_ms: float
    """Time for one microbatch to pass the whole module (its term in T_warmup)."""
    stage_ms: float
    """Time of one pipeline stage per microbatch (its candidate for the steady-state max)."""
    memory_gib: float | None
    """Predicted peak memory per GPU (first stage); None when the profile has no memory figures."""


@dataclass(frozen=True)
class Plan:
    """A complete layout with its predicted iteration time."""

    encoder: ModulePlan
    """Modality encoder layout."""
    llm: ModulePlan
    """LLM backbone layout."""
    generator: ModulePlan
    """Modality generator layout."""
    microbatches: int
    """Pipeline steps per iteration, K = global_batch / (DP_llm * M)."""
    t_warmup_ms: float
    """Warm-up and cool-down time (sum of the modules' warm-up terms)."""
    t_steady_ms: float
    """Steady-state time: the bottleneck stage time times (K - 1)."""
    t_iter_ms: float
    """t_warmup_ms + t_steady_ms."""
    mfu: float | None = None
    """Predicted model FLOPs utilisation of the GPUs used (0..1); None without FLOPs and peak."""
    layout: str = "disaggregated"
    """How modules share GPUs: ``disaggregated``, ``ratio-based`` or ``megatron``."""

    @property
    def gpus(self) -> int:
        """GPUs used by all three modules."""
        return self.encoder.gpus + self.llm.gpus + self.generator.gpus

    def module(self, name: str) -> ModulePlan:
        """The layout of module ``name``."""
        return getattr(self, name)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain data: per-module gpus/dp/tp/pp and the three times."""
        out: dict[str, Any] = {n: {"gpus": self.module(n).gpus, "dp": self.module(n).dp,
                                   "tp": self.module(n).tp, "pp": self.module(n).pp}
                               for n in MODULES}
        out.update(t_iter_ms=self.t_iter_ms, t_warmup_ms=self.t_warmup_ms,
                   t_steady_ms=self.t_steady_ms)
        return out


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def combine(w_llm: float, w_enc: float, w_gen: float, s_llm: float, s_enc: float,
            s_gen: float, microbatches: int) -> IterTime:
    """T_iter from the modules' warm-up terms and stage times (the canonical float order)."""
    warm = w_llm + (w_enc + w_gen)
    steady = max(s_llm, s_enc, s_gen) * (microbatches - 1)
    return IterTime(warm, steady, warm + steady)


def _samples(profile: Profile, name: str, d: int, dp: int) -> int:
    return profile.microbatch if name == "llm" else d // dp


def t_iter(profile: Profile, layout: Mapping[str, Degrees]) -> IterTime:
    """Predicted iteration time of ``layout`` (module name -> Degrees); pure, no feasibility
    checks beyond the divisibility the formula needs."""
    d = layout["llm"].dp * profile.microbatch
    if profile.global_batch % d or any(d % layout[n].dp for n in MODULES):
        raise ValueError(f"layout {dict(layout)} does not divide global batch {profile.global_batch}")
    w, s = {}, {}
    for n in MODULES:
        deg = layout[n]
        w[n] = _samples(profile, n, d, deg.dp) * profile.modules[n].cost_ms[deg.tp]
        s[n] = w[n] / deg.pp
    return combine(w["llm"], w["encoder"], w["generator"], s["llm"], s["encoder"],
                   s["generator"], profile.global_batch // d)


def _memory_bytes(spec: ModuleProfile, dp: Any, tp: Any, pp: Any, m: Any, in_flight: Any) -> Any:
    # Written once for Python ints and numpy arrays alike, so both give identical floats.
    shard = tp * pp
    if spec.frozen:
        per_param = spec.weight_bytes_per_param
    else:  # ZeRO-1: only optimizer states are sharded over the DP group
        per_param = spec.weight_bytes_per_param + spec.grad_bytes_per_param \
            + spec.optimizer_bytes_per_param / dp
    return spec.params / shard * per_param \
        + in_flight * m * spec.activation_bytes_per_sample / shard


def memory_per_gpu(spec: ModuleProfile, degrees: Degrees, *, samples_per_microbatch: int,
                   in_flight: int) -> float:
    """Bytes on a GPU of the first pipeline stage: weights and gradients of 1/(tp*pp) of the
    module, optimizer states further sharded over dp, and activations of ``in_flight``
    microbatches of ``samples_per_microbatch`` samples (1F1B: stage s of p holds min(p - s, K))."""
    return float(_memory_bytes(spec, degrees.dp, degrees.tp, degrees.pp, samples_per_microbatch,
                               in_flight))


def predicted_mfu(profile: Profile, t_iter_ms: float, gpus: int) -> float | None:
    """Model FLOPs of one iteration over the peak of ``gpus`` GPUs for ``t_iter_ms``; modules
    without ``flops_per_sample`` count as zero FLOPs. None without any FLOPs or a peak."""
    flops = [s.flops_per_sample for s in profile.modules.values() if s.flops_per_sample is not None]
    if not flops or profile.peak_tflops is None:
        return None
    return sum(flops) * profile.global_batch / (t_iter_ms * 1e-3 * gpus * profile.peak_tflops * 1e12)


def build_plan(profile: Profile, layout: Mapping[str, Degrees],
               layout_name: str = "disaggregated") -> Plan:
    """Evaluate a disaggregated ``layout`` into a Plan (times, memory, MFU); no search."""
    d = layout["llm"].dp * profile.microbatch
    k = profile.global_batch // d
    it = t_iter(profile, layout)
    mods = {}
    for n in MODULES:
        deg, spec = layout[n], profile.modules[n]
        m = _samples(profile, n, d, deg.dp)
        warm = m * spec.cost_ms[deg.tp]
        mem = memory_per_gpu(spec, deg, samples_per_microbatch=m, in_flight=min(deg.pp, k))
        mods[n] = ModulePlan(deg.dp * deg.tp * deg.pp, deg.dp, deg.tp, deg.pp, m, warm,
                             warm / deg.pp, mem / GIB if spec.has_memory_figures else None)
    gpus = sum(p.gpus for p in mods.values())
    return Plan(**mods, microbatches=k, t_warmup_ms=it.warmup_ms, t_steady_ms=it.steady_ms,
                t_iter_ms=it.total_ms, mfu=predicted_mfu(profile, it.total_ms, gpus),
                layout=layout_name)


@dataclass(frozen=True)
class _Opts:
    """Candidate layouts of one module for one D, as parallel columns."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    gpus: np.ndarray
    warm: np.ndarray
    stage: np.ndarray
    mem: np.ndarray
    rank: np.ndarray  # lexicographic rank of (tp, pp, dp), for tie-breaking

    def take(self, sel: np.ndarray) -> "_Opts":
        return _Opts(*(getattr(self, f)[sel] for f in self.__dataclass_fields__))

    def __len__(self) -> int:
        return len(self.dp)


def _module_grid(profile: Profile, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tp, pp, C(tp)) of every measured TP degree and pipeline degree of module ``name``."""
    spec = profile.modules[name]
    tps = spec.tp_degrees(profile.gpus_per_node)
    pps = divisors(spec.layers)
    tp = np.repeat(np.array(tps, dtype=np.int64), len(pps))
    cost = np.repeat(np.array([spec.cost_ms[t] for t in tps], dtype=np.float64), len(pps))
    return tp, np.tile(np.array(pps, dtype=np.int64), len(tps)), cost


def _options(profile: Profile, name: str, d: int, cap: int, limit: float | None,
             grid: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> _Opts:
    """Every (dp, tp, pp) of module ``name`` at D = d within ``cap`` GPUs and the memory limit."""
    spec = profile.modules[name]
    tp0, pp0, cost0 = grid if grid is not None else _module_grid(profile, name)
    dps = np.array([d // profile.microbatch] if name == "llm" else divisors(d), dtype=np.int64)
    dp = dps[:, None]  # rows: dp; columns: (tp, pp) combinations
    tp, pp, cost = tp0[None, :], pp0[None, :], cost0[None, :]
    m = np.full_like(dp, profile.microbatch) if name == "llm" else d // dp
    warm = m * cost
    in_flight = np.minimum(pp, profile.global_batch // d)
    gpus = dp * tp * pp
    mem = np.broadcast_to(_memory_bytes(spec, dp, tp, pp, m, in_flight), gpus.shape)
    ok = gpus <= cap
    if limit is not None:
        ok &= mem <= limit
    rank = (tp * (spec.layers + 1) + pp) * (d + 1) + dp
    cols = (dp, tp, pp, gpus, warm, warm / pp, mem, rank)
    return _Opts(*(np.broadcast_to(c, gpus.shape)[ok] for c in cols))


def _pareto(o: _Opts) -> _Opts:
    """Drop layouts some other layout beats: no more GPUs, warm-up or stage time, and fewer GPUs
    or an earlier tie-break rank. Swapping it in never worsens T_iter (float sums are monotone),
    the GPU count or the tie-break, so the exact optimum survives."""
    if len(o) <= 1:
        return o
    g, w, s, r = o.gpus, o.warm, o.stage, o.rank
    dom = (g[:, None] <= g) & (w[:, None] <= w) & (s[:, None] <= s) \
        & ((g[:, None] < g) | (r[:, None] < r))
    return o.take(~dom.any(axis=0))


def _batch_splits(profile: Profile) -> list[int]:
    """Every D = DP_llm * M that divides the global batch."""
    m = profile.microbatch
    return [d for d in divisors(profile.global_batch) if d % m == 0]


def _search(profile: Profile, caps: Mapping[str, int]) -> Plan | None:
    n_gpus, limit = profile.gpus, profile.memory_limit_bytes
    grids = {n: _module_grid(profile, n) for n in MODULES}
    groups = []
    for d in _batch_splits(profile):
        k = profile.global_batch // d
        opts = [_options(profile, n, d, caps[n], limit, grids[n])
                for n in ("llm", "encoder", "generator")]
        if min(len(o) for o in opts) == 0 or sum(int(o.gpus.min()) for o in opts) > n_gpus:
            continue
        lb = combine(*(float(o.warm.min()) for o in opts),
                     *(float(o.stage.min()) for o in opts), k).total_ms
        groups.append((lb, d, k, opts))
    best: tuple | None = None
    for lb, d, k, opts in sorted(groups, key=lambda g: (g[0], g[1])):
        if best is not None and lb > best[0][0]:
            break  # groups are sorted by a valid lower bound: none of the rest can win
        opts = _prune(opts, k, n_gpus, None if best is None else best[0][0])
        if opts is None:
            continue
        found = _best_in_group(opts, k, n_gpus)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        return None
    return build_plan(profile, best[1])


def _prune(opts: list[_Opts], k: int, n_gpus: int, bound: float | None) -> list[_Opts] | None:
    """Remove layouts that cannot be part of a plan within ``n_gpus`` and ``bound``, then keep
    each module's non-dominated layouts."""
    wmin = [float(o.warm.min()) for o in opts]
    smin = [float(o.stage.min()) for o in opts]
    gmin = [int(o.gpus.min()) for o in opts]
    out = []
    for i, o in enumerate(opts):
        keep = o.gpus <= n_gpus - (sum(gmin) - gmin[i])
        if bound is not None:  # optimistic T_iter with the other modules at their best
            w, s = list(wmin), list(smin)
            w[i], s[i] = o.warm, o.stage
            keep &= (w[0] + (w[1] + w[2])) + np.maximum(np.maximum(s[0], s[1]), s[2]) * (k - 1) \
                <= bound
        o = _pareto(o.take(keep))
        if len(o) == 0:
            return None
        out.append(o)
    return out


def _best_in_group(opts: list[_Opts], k: int, n_gpus: int) -> tuple | None:
    """Exact best (key, layout) for one D by evaluating every (llm, encoder, generator) triple."""
    lm, en, ge = opts
    wp = (en.warm[:, None] + ge.warm[None, :]).ravel()
    sp = np.maximum(en.stage[:, None], ge.stage[None, :]).ravel()
    gp = (en.gpus[:, None] + ge.gpus[None, :]).ravel()
    warm = lm.warm[:, None] + wp[None, :]
    total = warm + np.maximum(lm.stage[:, None], sp[None, :]) * (k - 1)
    total[gp[None, :] > (n_gpus - lm.gpus)[:, None]] = np.inf
    tmin = float(total.min())
    if tmin == np.inf:
        return None
    best = None
    for li, pi in zip(*np.nonzero(total == tmin)):
        ei, gi = divmod(int(pi), len(ge))
        layout = {n: Degrees(int(o.dp[j]), int(o.tp[j]), int(o.pp[j]))
                  for n, o, j in (("encoder", en, ei), ("llm", lm, li), ("generator", ge, gi))}
        key = _key(tmin, layout)
        if best is None or key < best[0]:
            best = (key, layout)
    return best


def _key(total_ms: float, layout: Mapping[str, Degrees]) -> tuple:
    """Ordering of plans: faster, then fewer GPUs, then smaller (tp, pp, dp) in pipeline order."""
    gpus = sum(d.dp * d.tp * d.pp for d in layout.values())
    return (total_ms, gpus) + tuple(x for n in MODULES
                                    for x in (layout[n].tp, layout[n].pp, layout[n].dp))


def plan(profile: Profile, *, gpu_caps: Mapping[str, int] | None = None) -> Plan:
    """The exact minimum-T_iter layout; ``gpu_caps`` optionally bounds each module's GPUs.
    Raises PlanError with the binding constraint when nothing is feasible."""
    caps = {n: profile.gpus if gpu_caps is None else min(gpu_caps[n], profile.gpus)
            for n in MODULES}
    found = _search(profile, caps)
    if found is None:
        raise PlanError(_diagnose(profile, caps))
    return found


def exhaustive_plan(profile: Profile) -> Plan:
    """Reference optimum by brute force over every layout (small instances only; for tests)."""
    n_gpus, bs, limit = profile.gpus, profile.global_batch, profile.memory_limit_bytes
    best = None
    for dp_llm in range(1, bs + 1):
        d = dp_llm * profile.microbatch
        if bs % d:
            continue
        cands = {}
        for n in MODULES:
            spec = profile.modules[n]
            dps = [dp_llm] if n == "llm" else [x for x in range(1, d + 1) if d % x == 0]
            cands[n] = [Degrees(dp, tp, pp) for dp in dps
                        for tp in spec.tp_degrees(profile.gpus_per_node)
                        for pp in range(1, spec.layers + 1)
                        if spec.layers % pp == 0 and dp * tp * pp <= n_gpus
                        and (limit is None or memory_per_gpu(
                            spec, Degrees(dp, tp, pp), samples_per_microbatch=_samples(
                                profile, n, d, dp), in_flight=min(pp, bs // d)) <= limit)]
        for lm in cands["llm"]:
            for en in cands["encoder"]:
                for ge in cands["generator"]:
                    layout = {"encoder": en, "llm": lm, "generator": ge}
                    if sum(x.dp * x.tp * x.pp for x in layout.values()) > n_gpus:
                        continue
                    key = _key(t_iter(profile, layout).total_ms, layout)
                    if best is None or key < best[0]:
                        best = (key, layout)
    if best is None:
        raise PlanError(_diagnose(profile, {n: n_gpus for n in MODULES}))
    return build_plan(profile, best[1])


def _diagnose(profile: Profile, caps: Mapping[str, int]) -> str:
    """One line naming the constraint that leaves no feasible layout."""
    bs, m, n_gpus = profile.global_batch, profile.microbatch, profile.gpus
    if bs % m:
        return f"global_batch {bs} is not divisible by microbatch {m}: no data-parallel degree fits"
    for n in MODULES:
        if not profile.modules[n].tp_degrees(profile.gpus_per_node):
            return (f"{n}: no TP degree in cost_ms ({', '.join(map(str, profile.modules[n].cost_ms))})"
                    f" is <= gpus_per_node ({profile.gpus_per_node})")
    limit, big = profile.memory_limit_bytes, 1 << 62
    ds = _batch_splits(profile)
    need: dict[str, int] = {}
    for n in MODULES:
        sizes = [int(o.gpus.min()) for d in ds if len(o := _options(profile, n, d, big, limit))]
        if not sizes:  # only memory can empty a module's options
            everything = [(float(o.mem[i]), o, i) for d in ds
                          if len(o := _options(profile, n, d, big, None)) for i in range(len(o))]
            mem, o, i = min(everything, key=lambda x: x[0])
            return (f"{n}: no layout fits in {profile.gpu_memory_gb:g} GiB per GPU (the leanest, "
                    f"dp={o.dp[i]} tp={o.tp[i]} pp={o.pp[i]}, needs {mem / GIB:.1f} GiB)")
        need[n] = min(sizes)
        if need[n] > caps[n] and caps[n] < n_gpus:
            return f"{n} is capped at {caps[n]} GPUs but its smallest feasible layout needs {need[n]}"
    free = sum(min(int(o.gpus.min()) for d in ds if len(o := _options(profile, n, d, big, None)))
               for n in MODULES)
    why = " to fit in memory" if sum(need.values()) > free else ""
    split = " + ".join(f"{n} {need[n]}" for n in MODULES)
    if sum(need.values()) > n_gpus:
        return f"needs at least {sum(need.values())} GPUs{why} ({split}), profile has {n_gpus}"
    return (f"no single DP_llm * microbatch split of global_batch {bs} lets all three modules fit "
            f"in {n_gpus} GPUs at once (each alone needs {split})")

"""Profiles: what the orchestration optimizer knows about a model and a cluster.

A profile is a JSON object (see ``docs/planner.md`` for the schema with examples)::

    {"gpus": 1296, "global_batch": 1920, "microbatch": 1, "gpus_per_node": 8,
     "gpu_memory_gb": 80, "peak_tflops": 312,
     "modules": {"encoder":   {"layers": 32, "cost_ms": {"1": 216, "2": 120, ...}},
                 "llm":       {"layers": 80, "cost_ms": {...}, "params": 7.0e10, ...},
                 "generator": {"layers": 12, "cost_ms": {...}}}}

``modules`` describes a module graph (:mod:`disttrain_ds.graph`): any number of encoders feed
the one LLM, which feeds any number of generators. Each module may say its ``role``
(encoder | llm | generator); a module named ``encoder``, ``llm`` or ``generator`` without one
takes its name as its role, so three-module profiles need no roles at all.

Loading validates everything up front and raises ``ProfileError`` whose message is one line naming
the field and the file, so a typo never turns into a silently wrong plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disttrain_ds.errors import ConfigError
from disttrain_ds.graph import DEFAULT_ROLES, ROLES, ModuleGraph

if TYPE_CHECKING:
    from disttrain_ds.cost.memory_model import StageTable


TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
"""Tensor-parallel degrees the planner considers (TP stays inside one node)."""

COST_SOURCES: tuple[str, ...] = ("measured", "interpolated", "assumed")
"""Where a ``cost_ms`` entry comes from (``cost_source``): timed by the profiler, scaled from a
measured degree, or given without a measurement (the default for a degree the profile does not
declare)."""

GIB = 2**30
"""Bytes in the unit of ``gpu_memory_gb`` (vendors' "80 GB" GPUs hold 80 GiB)."""
AUTO_SP = 0
"""The SP degree that stands for adaptive groups (``parallel.<module>.sp: auto``) in plans and
layouts: the module's replicas regroup every microbatch, so it occupies ``dp x tp x pp`` GPUs."""


class ProfileError(ConfigError):
    """A profile is invalid; the message is one line naming the field and the file."""


def sp_head_problem(heads: int, kv_heads: int, tp: int, sp: int) -> str | None:
    """Which head count keeps SP degree ``sp`` from splitting attention at TP ``tp`` ("heads" or
    "kv_heads"), or None: query heads per TP rank must divide by SP; KV heads per TP rank must divide
    it or be divisible by it (fewer are repeated, ``models/doc_mask.py``)."""
    if heads % tp or (heads // tp) % sp:
        return "heads"
    kv = kv_heads // tp if kv_heads % tp == 0 else 0
    if not kv or (kv % sp and sp % kv):
        return "kv_heads"
    return None


@dataclass(frozen=True)
class ModuleProfile:
    """Measured cost and (optional) memory figures of one module."""

    layers: int
    """Number of identical layers (blocks); a pipeline degree must divide it."""
    cost_ms: dict[int, float]
    """TP degree -> forward+backward time in ms of the whole module for one sample on that many
    GPUs, TP communication included (the paper's C(TP)). Only the degrees given are considered;
    nothing is interpolated. For the LLM a sample is one packed sequence; for the encoder and the
    generator it is the images of one packed sequence."""
    params: float = 0.0
    """Parameter count of the whole module; 0 leaves parameter memory out of the model."""
    frozen: bool = False
    """True when the module is not trained: no gradients and no optimizer states are held."""
    weight_bytes_per_param: float = 2.0
    """Bytes per parameter for the weights (2 for bf16)."""
    grad_bytes_per_param: float = 2.0
    """Bytes per parameter for gradients (ignored when frozen)."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer bytes per parameter before ZeRO-1 sharding over the module's DP group (12: fp32
    master weights + Adam moments); ignored when frozen."""
    activation_bytes_per_sample: float = 0.0
    """Activation bytes kept for backward by the whole module for one sample at TP=1; split evenly
    over pipeline stages; the fraction ``activation_tp_sharded`` of it is split over TP, the rest
    is replicated on every TP rank. Use 0 for a frozen encoder, whose activations are never needed
    for backward."""
    activation_tp_sharded: float = 0.0
    """Fraction (0..1) of ``activation_bytes_per_sample`` that TP splits (attention and MLP
    internals); without sequence parallelism norms' inputs and layer outputs stay whole on every
    TP rank. 0, the default, counts everything as replicated."""
    flops_per_sample: float | None = None
    """Forward+backward FLOPs of the whole module for one sample; used only for predicted MFU."""
    sample_cost_ms: tuple[float, ...] | None = None
    """A representative draw of per-sample forward+backward times in ms at TP=1; entry i of every
    module's draw belongs to the same sample. With it the planner prices each stage by its
    expected slowest DP replica (:mod:`disttrain_ds.planner.hetero`) instead of the mean."""
    unit_cost_ms: tuple[tuple[float, ...], ...] | None = None
    """Per sample of ``sample_cost_ms``, the ms of each of its units of work in this module (an
    encoder's images or audio clips, a generator's target images), summing to that sample's entry.
    With it and ``Profile.post_balance_share`` the planner splits units over the replicas, as the
    runtime's post-balancing does; without, whole samples."""
    activation_checkpointing: int = 0
    """Layers per checkpointed block (the recipe's ``parallel.<module>.activation_checkpointing``):
    a microbatch in flight keeps only each block's input, and backward recomputes one block at a
    time. 0: every activation is kept."""
    layer_output_bytes_per_sample: float = 0.0
    """Bytes one layer hands to the next for one sample at TP=1 (what a checkpointed block keeps);
    read only with ``activation_checkpointing``."""
    sp_overhead_ms: dict[int, float] = field(default_factory=dict)
    """The LLM: SP degree -> milliseconds of one sample's all-to-alls (forward and backward) at TP=1
    (each TP rank moves 1/tp of them); the degrees listed (besides 1) are those the planner may
    choose. ``disttrain-profile`` models them from the model's sizes, the data's mean sequence
    length and ``parallel.sp_bandwidth_gbs``. Empty: no sequence parallelism."""
    attention_heads: tuple[int, int] = (0, 0)
    """(query heads, KV heads) of the LLM: an SP degree must split the heads per TP rank (and the KV
    heads, or be split by them); (0, 0): not checked."""
    sp_seq_len: int = 0
    """The LLM's ``data.seq_len``, which adaptive groups of all its replicas must split (set from a
    recipe by ``planner/legal.py``, never read from JSON); 0: not checked."""
    adaptive: bool = True
    """Whether the planner may give the module adaptive SP groups (``sp: auto``; set from a recipe by
    ``planner/legal.py``, never read from JSON: not with emulated compute or per-host reading)."""
    cost_source: dict[int, str] = field(default_factory=dict)
    """TP degree -> ``measured`` | ``interpolated`` | ``assumed`` for the entries of ``cost_ms``;
    a degree not listed is ``assumed``."""
    optimizer_sharded: bool = True
    """Whether optimizer states shard over the module's DP group (ZeRO-1, DeepSpeed's bf16
    optimizer); False for ZeRO-0 in fp32 (set from a recipe by ``planner/legal.py``, never read
    from JSON)."""
    max_pp: int | None = None
    """Largest pipeline degree the runtime accepts for this module (set from a recipe by
    ``planner/legal.py``, never read from JSON); None: only "PP divides ``layers``"."""
    stages: StageTable | None = None
    """(tp, pp) -> each pipeline stage's parameters and per-sample activation bytes as the runtime
    splits the module (uneven stages, each stage's received input and output, its backward
    workspace); set from a recipe by ``planner/recipe_memory.py``, never read from JSON. With it
    the memory check prices every stage as the runtime's estimate does (the figures above are then
    not read); None: even stages from the per-sample figures above."""
    extra_bytes_per_rank: float = 0.0
    """Bytes every rank of the module holds beside its pipeline stage (a frozen model run outside
    the pipeline); set from a recipe by ``planner/recipe_memory.py``, never read from JSON."""
    reduce_bucket_bytes: float = 0.0
    """Bytes of one gradient bucket DeepSpeed's ZeRO optimizer allocates (``reduce_bucket_size``
    fp32 elements; ``memory_model.with_buckets``); set from a recipe by
    ``planner/recipe_memory.py``, never read from JSON."""
    refused: frozenset[tuple[int, int, int]] = frozenset()
    """(dp, tp, pp) layouts the runtime's memory check refused for this module (set by
    ``planner/recipe_memory.fit_plan``, never read from JSON): priced as not fitting."""

    def cost(self, tp: int, sp: int = 1) -> float:
        """Forward+backward ms of one sample at TP ``tp`` and SP ``sp``: the compute split over the
        SP group, plus its all-to-alls (``sp_overhead_ms``) split over the TP ranks. ``AUTO_SP``:
        the mean cost at SP 1 (the planner's straggler factor prices the groups)."""
        if sp in (1, AUTO_SP):
            return self.cost_ms[tp]
        return self.cost_ms[tp] / sp + self.sp_overhead_ms[sp] / tp

    def sp_degrees(self, gpus_per_node: int, tp: int) -> tuple[int, ...]:
        """SP degrees the planner may give this module at TP ``tp``: 1, and those of
        ``sp_overhead_ms`` whose TP x SP ranks fit a node and whose heads they split."""
        heads, kv = self.attention_heads
        out = [1]
        for s in sorted(self.sp_overhead_ms):
            if tp * s > gpus_per_node or gpus_per_node % (tp * s):
                continue
            if heads and sp_head_problem(heads, kv, tp, s):
                continue
            out.append(s)
        return tuple(out)

    def auto_sp(self, dp: int, tp: int) -> bool:
        """Whether adaptive SP groups (``sp: auto``) may run over ``dp`` replicas at TP ``tp``: the
        module has SP overheads and a per-sample draw to price them by, ``dp`` is a power of two of
        at least 2, and a group of all ``dp`` replicas splits the heads per TP rank."""
        if not (self.adaptive and self.sp_overhead_ms) or self.sample_cost_ms is None or dp < 2 or dp & (dp - 1):
            return False
        if self.sp_seq_len and self.sp_seq_len % dp:
            return False
        heads, kv = self.attention_heads
        return not (heads and sp_head_problem(heads, kv, tp, dp))

    def source(self, tp: int) -> str:
        """Where ``cost_ms[tp]`` comes from (``COST_SOURCES``)."""
        return self.cost_source.get(tp, "assumed")

    @property
    def has_memory_figures(self) -> bool:
        """Whether the profile says anything about this module's memory."""
        return self.params > 0 or self.activation_bytes_per_sample > 0

    def tp_degrees(self, gpus_per_node: int) -> tuple[int, ...]:
        """TP degrees with a cost that divide ``gpus_per_node``, ascending: with module rank ranges
        starting at multiples of their TP degree (``search.py``), no TP group then spans nodes."""
        return tuple(t for t in sorted(self.cost_ms) if gpus_per_node % t == 0)

    def pp_degrees(self) -> tuple[int, ...]:
        """Pipeline degrees: divisors of ``layers`` (even stages), at most ``max_pp``, ascending."""
        small = [d for d in range(1, int(self.layers**0.5) + 1) if self.layers % d == 0]
        pps = small + [self.layers // d for d in reversed(small) if d * d != self.layers]
        return tuple(p for p in pps if self.max_pp is None or p <= self.max_pp)


@dataclass(frozen=True)
class Profile:
    """Everything the orchestration optimizer needs: cluster size, batch and per-module costs."""

    gpus: int
    """GPUs available to the job (the three modules' GPU counts may not add up to more)."""
    global_batch: int
    """Samples (packed sequences) per training iteration."""
    modules: dict[str, ModuleProfile]
    """Module name -> its profile, in the graph's data-flow order (reordered on construction)."""
    microbatch: int = 1
    """Samples per LLM microbatch (M); DP_llm * M must divide ``global_batch``."""
    gpus_per_node: int = 8
    """GPUs per node; a TP degree must divide it, and no TP group may span two nodes."""
    gpu_memory_gb: float | None = None
    """Usable memory per GPU in GiB; when absent no layout is rejected for memory."""
    peak_tflops: float | None = None
    """Peak dense throughput per GPU in TFLOPS (312 for A800 bf16); enables predicted MFU."""
    description: str = ""
    """Free text shown nowhere by the optimizer; say where the numbers come from."""
    post_balance_share: float = 0.0
    """The runtime's ``parallel.post_balance_share`` when the job post-balances (encoders and
    generators split each microbatch by their own costs, a replica taking up to this multiple of
    its even share): the straggler factors price those splits; 0: contiguous, equal blocks."""
    graph: ModuleGraph | None = None
    """Who feeds whom; None takes each module's name as its role (only ``encoder``, ``llm`` and
    ``generator`` can). Always a ModuleGraph once constructed."""

    def __post_init__(self) -> None:
        graph = self.graph
        if graph is None:
            graph = roles_graph({n: default_role(n, "<profile>") for n in self.modules}, "<profile>")
        if set(graph.names) != set(self.modules):
            raise ProfileError(f"<profile>: 'modules' ({', '.join(self.modules)}) are not the "
                               f"graph's modules ({', '.join(graph.names)})")
        # Frozen dataclass: set the derived fields once, here.
        object.__setattr__(self, "graph", graph)
        object.__setattr__(self, "modules", {n: self.modules[n] for n in graph.names})
        check_draws(self.modules, "<profile>")

    @property
    def has_draw(self) -> bool:
        """Whether the modules carry per-sample cost draws (``sample_cost_ms``)."""
        return any(m.sample_cost_ms is not None for m in self.modules.values())

    def module(self, name: str) -> ModuleProfile:
        """The profile of module ``name`` (one of ``graph.names``)."""
        return self.modules[name]

    @property
    def memory_limit_bytes(self) -> float | None:
        """``gpu_memory_gb`` in bytes, or None when memory is not constrained."""
        return None if self.gpu_memory_gb is None else self.gpu_memory_gb * GIB


def default_role(name: str, src: str) -> str:
    """The role of a module a profile names without one (``encoder``, ``llm``, ``generator``)."""
    if name in DEFAULT_ROLES:
        return DEFAULT_ROLES[name]
    raise ProfileError(f"{src}: 'modules.{name}' needs a role: missing required field "
                       f"'modules.{name}.role' ({' | '.join(ROLES)}; only a module named "
                       "encoder, llm or generator may leave it out)")


def roles_graph(roles: dict[str, str], src: str) -> ModuleGraph:
    """The module graph of ``roles``; its problems as ``ProfileError``s."""
    try:
        return ModuleGraph.from_roles(roles, src, key="modules")
    except ConfigError as exc:  # the graph's own one-line message, as a profile error
        raise ProfileError(str(exc)) from None


def check_draws(modules: dict[str, ModuleProfile], src: str) -> None:
    """Per-sample draws are all-or-nothing per sample: every module that has one has the same
    length (entry i of each belongs to sample i); a module's unit draw splits its sample draw."""
    for n, m in modules.items():
        if m.unit_cost_ms is None:
            continue
        if m.sample_cost_ms is None or len(m.unit_cost_ms) != len(m.sample_cost_ms):
            raise ProfileError(f"{src}: 'modules.{n}.unit_cost_ms' needs one list per entry of "
                               f"'modules.{n}.sample_cost_ms' ({len(m.sample_cost_ms or ())}), got {len(m.unit_cost_ms)}")
        for i, (units, total) in enumerate(zip(m.unit_cost_ms, m.sample_cost_ms)):
            if abs(sum(units) - total) > 1e-6 * max(1.0, total):
                raise ProfileError(f"{src}: 'modules.{n}.unit_cost_ms[{i}]' sums to {sum(units):.6g} ms but "
                                   f"'modules.{n}.sample_cost_ms[{i}]' is {total:.6g} (a sample's units add up to it)")
    lengths = {n: len(m.sample_cost_ms) for n, m in modules.items() if m.sample_cost_ms is not None}
    if not lengths:
        return
    first = next(iter(lengths))
    for n, k in lengths.items():
        if k != lengths[first]:
            raise ProfileError(f"{src}: 'modules.{n}.sample_cost_ms' has {k} entries but "
                               f"'modules.{first}.sample_cost_ms' has {lengths[first]} (entry i of every module is "
                               "the same sample)")
    missing = [n for n in modules if n not in lengths]
    if missing:
        raise ProfileError(f"{src}: missing field 'modules.{missing[0]}.sample_cost_ms' (every "
                           f"module needs a draw when one has it, here '{first}')")

"""What the orchestration optimizer returns: a layout per module with its predicted times."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disttrain_ds.cost.profile import AUTO_SP
from disttrain_ds.graph import ModuleGraph
from disttrain_ds.planner.objective import Degrees


class PlanError(ValueError):
    """No layout satisfies the constraints; the message is one line naming the binding one."""


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
    straggler: float = 1.0
    """Expected slowest replica's load over the mean one, h(dp, m), already in ``warmup_ms``
    (1.0 without per-sample draws)."""
    cost_source: str = "assumed"
    """Where the cost at this TP degree comes from: measured | interpolated | assumed."""
    pace: float = 1.0
    """Expected slowest of PP steps' slowest replicas over the mean replica load, g(dp, m, pp),
    already in ``stage_ms`` (1.0 without per-sample draws)."""
    sp: int = 1
    """Sequence-parallel degree (``parallel.<module>.sp``): ranks per replica splitting each sequence;
    ``AUTO_SP`` (0): adaptive groups over the replicas (``sp: auto``)."""

    @property
    def sp_setting(self) -> int | str:
        """``sp`` as a recipe writes it: a degree, or ``auto``."""
        return "auto" if self.sp == AUTO_SP else self.sp


@dataclass(frozen=True)
class Plan:
    """A complete layout with its predicted iteration time."""

    modules: dict[str, ModulePlan]
    """Module name -> its layout, in the graph's data-flow order."""
    graph: ModuleGraph
    """The module graph the plan lays out (the profile's)."""
    microbatches: int
    """Pipeline steps per iteration, K = global_batch / (DP_llm * M)."""
    t_warmup_ms: float
    """Warm-up and cool-down time (the modules' warm-up terms along the critical path)."""
    t_steady_ms: float
    """Steady-state time: the bottleneck stage time times (K - 1)."""
    t_iter_ms: float
    """t_warmup_ms + t_steady_ms."""
    mfu: float | None = None
    """Predicted model FLOPs utilisation of the GPUs used (0..1) over ``t_pred_ms``; None
    without FLOPs and peak."""
    layout: str = "disaggregated"
    """How modules share GPUs: ``disaggregated``, ``ratio-based`` or ``megatron``."""
    t_pred_ms: float | None = None
    """Predicted iteration time under the runtime's 1F1B schedule (``pipeline.predict``):
    t_iter_ms less what the schedule overlaps; <= t_iter_ms. None: not computed."""
    t_sim_ms: float | None = None
    """With per-sample draws: the mean simulated iteration on global batches resampled from the
    draw (``optimize.simulated_ms``), the figure the finalists were chosen by. None: not simulated."""
    finalists: int = 1
    """Layouts the search handed to the simulator (1: the closed form's best, not simulated)."""

    @property
    def gpus(self) -> int:
        """GPUs used by all modules."""
        return sum(m.gpus for m in self.modules.values())

    @property
    def llm(self) -> ModulePlan:
        """The LLM's layout (every graph has exactly one LLM)."""
        return self.modules[self.graph.llm]

    def module(self, name: str) -> ModulePlan:
        """The layout of module ``name``."""
        return self.modules[name]

    def degrees(self) -> dict[str, Degrees]:
        """Module name -> (dp, tp, pp, sp), the layout ``t_iter`` and ``build_plan`` take."""
        return {n: Degrees(m.dp, m.tp, m.pp, m.sp) for n, m in self.modules.items()}

    def to_json(self) -> dict[str, Any]:
        """The plan as plain data: per-module gpus/dp/tp/pp, the closed form's three times, the
        predicted time under 1F1B, where each module's cost at its TP degree comes from, and the
        simulated time when the plan was chosen among finalists."""
        out: dict[str, Any] = {n: {"gpus": m.gpus, "dp": m.dp, "tp": m.tp, "pp": m.pp,
                                   **({"sp": m.sp_setting} if m.sp != 1 else {})}
                               for n, m in self.modules.items()}
        out.update(t_iter_ms=self.t_iter_ms, t_warmup_ms=self.t_warmup_ms,
                   t_steady_ms=self.t_steady_ms, t_pred_ms=self.t_pred_ms,
                   cost_source={n: m.cost_source for n, m in self.modules.items()})
        if self.t_sim_ms is not None:  # chosen among finalists by simulation
            out.update(t_sim_ms=self.t_sim_ms, finalists=self.finalists)
        return out

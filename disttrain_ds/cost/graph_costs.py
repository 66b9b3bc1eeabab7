"""Per-sample costs of every module of a graph, by module name.

A graph's modules are named by its recipe (``vision``, ``ear``, ``llm``, ``painter`` ...); each is
costed by its kind in the shared :class:`~disttrain_ds.cost.model.CostModel`: an image encoder by
its input images, an audio encoder by its input clips, the LLM by its packed sequence, a
generator by its generated images. Reordering, the ``balance/<module>_*`` figures, emulated
compute and the profiler's per-sample draws all read one ``GraphCosts``, so every module of the
graph, a second encoder included, is priced the same way everywhere. Each module is priced by its
own family's cost terms (``own``), each generator by its own targets (the k-th generator in graph
order by ``SampleStats.gen(k)``: its image count and side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from disttrain_ds.cost.model import CostModel
from disttrain_ds.samples import SampleStats

ROLE_OF_KIND = {"encoder": "encoder", "audio": "encoder", "llm": "llm", "generator": "generator"}
"""The graph role of each cost kind (both encoder kinds are encoders)."""
STAGE_ROLES = ("encoder", "llm", "generator")
"""The pipeline's three stages in data-flow order: the encoders run side by side on their own
ranks, as do the generators, so a stage's time is its slowest module's."""


@dataclass(frozen=True)
class GraphCosts:
    """Forward cost of one sample in each module of a graph."""

    model: CostModel
    """The coefficients of every cost kind (FLOPs, or ms after ``CostModel.in_ms``) for the modules
    ``own`` does not name; its ``backward_factor`` is the graph's."""
    kinds: dict[str, str]
    """Module name -> its cost kind (``cost.model.Module``: encoder | audio | llm | generator: what
    the module's work is counted in), in the graph's data-flow order."""
    own: dict[str, CostModel] = field(default_factory=dict)
    """Module name -> the model whose terms of the module's kind price it (its own family's); a
    module not named here uses ``model``'s."""

    def __post_init__(self) -> None:
        bad = {n: k for n, k in self.kinds.items() if k not in ROLE_OF_KIND}
        if bad:
            raise ValueError(f"cost kinds must be among {sorted(ROLE_OF_KIND)}, got {bad}")
        stray = sorted(set(self.own) - set(self.kinds))
        if stray:
            raise ValueError(f"own names modules the graph does not have: {stray}")

    @classmethod
    def three_module(cls, model: CostModel) -> "GraphCosts":
        """The classic graph: modules ``encoder`` (images), ``llm`` and ``generator``."""
        return cls(model, {"encoder": "encoder", "llm": "llm", "generator": "generator"})

    @property
    def names(self) -> tuple[str, ...]:
        """Module names, in data-flow order (the columns of ``costs``)."""
        return tuple(self.kinds)

    @property
    def backward_factor(self) -> float:
        """Backward cost as a multiple of forward (the model's)."""
        return self.model.backward_factor

    def role(self, name: str) -> str:
        """encoder | llm | generator of module ``name``."""
        return ROLE_OF_KIND[self.kinds[name]]

    def column(self, name: str) -> int:
        """Index of module ``name`` among the columns of ``costs``."""
        return self.names.index(name)

    def module_cost(self, name: str, s: SampleStats) -> float:
        """Forward cost of ``s`` in module ``name`` (a generator: of its own targets, by its own terms)."""
        if name not in self.kinds:
            raise ValueError(f"no module {name!r} in the cost model (modules: {', '.join(self.names)})")
        kind, model = self.kinds[name], self.own.get(name, self.model)
        if kind != "generator":
            return model.module_cost(kind, s)
        return model.generator_cost(s, self._gen_index[name])

    @cached_property
    def _gen_index(self) -> dict[str, int]:
        """Generator name -> its place among the generators (graph order): whose targets it reads."""
        return {n: k for k, n in enumerate(n for n, kd in self.kinds.items() if kd == "generator")}

    def costs(self, samples: Sequence[SampleStats]) -> np.ndarray:
        """``[n, len(names)]`` forward costs of each sample in each module."""
        return np.array([[self.module_cost(n, s) for n in self.kinds] for s in samples],
                        dtype=np.float64).reshape(-1, len(self.kinds))

    def train_cost(self, s: SampleStats) -> float:
        """Forward plus backward cost of ``s`` through every module of the graph."""
        return sum(self.module_cost(n, s) for n in self.kinds) * (1.0 + self.backward_factor)

    def stage_times(self, per_module: np.ndarray) -> np.ndarray:
        """``[..., 3]`` encoder, LLM and generator stage times from ``[..., len(names)]`` per-module
        times: the slowest module of each role (0 for a role the graph lacks)."""
        t = np.asarray(per_module, dtype=np.float64)
        out = np.zeros(t.shape[:-1] + (len(STAGE_ROLES),))
        for j, role in enumerate(STAGE_ROLES):
            cols = [i for i, n in enumerate(self.names) if self.role(n) == role]
            if cols:
                out[..., j] = t[..., cols].max(axis=-1)
        return out


def unit_costs(spec, costs: GraphCosts, module: str, s) -> list[float]:
    """Forward cost of each of sample ``s``'s units in encoder or generator ``module`` (an encoder's
    images or clips, sized by its family through ``spec``, the model spec; a generator's target
    images), each priced on its own by the module's cost terms."""
    cfg, fam = spec.config(module), spec.family(module)
    if fam.role == "generator":
        k = spec.gen_index(module)
        t = s.targets(k)
        one = SampleStats(0, (), 0, gens=((0, 0),) * k + ((1, int(t.shape[-1]) if t is not None else 0),))
        return [costs.module_cost(module, one)] * (0 if t is None else int(t.shape[0]))
    if fam.modality == "image":
        return [costs.module_cost(module, SampleStats(0, (fam.item_size(cfg, im),), 0)) for im in s.images]
    return [costs.module_cost(module, SampleStats(0, (), 0, audio_frames=(fam.item_size(cfg, c),))) for c in s.audio]


def as_graph_costs(model: GraphCosts | CostModel | None) -> GraphCosts:
    """``model`` as a ``GraphCosts``: a bare ``CostModel`` prices the three-module graph; None is
    the paper's MLLM (ViT-H/14, Llama-3 7B, SD 2.1) in FLOPs."""
    if isinstance(model, GraphCosts):
        return model
    return GraphCosts.three_module(model if model is not None else CostModel.paper_mllm())

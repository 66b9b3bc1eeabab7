"""The training dashboard as a wandb workspace: plain data, plus a function that saves it to a
wandb project (online only; needs ``pip install wandb-workspaces`` and a wandb login).

The same panels as ``tools/report.py`` draws offline: losses (training and validation), MFU per
module, step-time breakdown and data-parallel load balance, each a line plot against the
optimizer step. Panels
are per module name, so every module graph gets its own dashboard (``graph_dashboard``); an
online run saves its graph's dashboard when it starts (``metrics/logger.py``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from disttrain_ds.graph import ModuleGraph


@dataclass(frozen=True)
class Panel:
    """One line plot."""

    title: str
    """Panel title."""
    keys: tuple[str, ...]
    """Metric keys drawn as lines against the step (as logged by ``RunLogger``)."""


@dataclass(frozen=True)
class Section:
    """A collapsible group of panels."""

    name: str
    """Section title."""
    panels: tuple[Panel, ...]
    """Panels in display order."""


def dashboard(modules: tuple[str, ...], balanced: tuple[str, ...], evaluated: tuple[str, ...]) -> tuple[Section, ...]:
    """The dashboard of a model whose modules are ``modules`` (metric keys are per module name);
    ``balanced``: the modules whose data-parallel load balance is logged (encoders, generators);
    ``evaluated``: the modules whose part of the validation loss is logged (the LLM, generators)."""
    return (
        Section("Loss", (
            Panel("total loss", ("loss/total",)),
            Panel("LM loss", ("loss/lm",)),
            Panel("generation loss", ("loss/gen",)),
            Panel("validation loss", ("eval/loss", *(f"eval/loss/{m}" for m in evaluated))),
        )),
        Section("MFU", (
            Panel("MFU per module", tuple(f"perf/mfu/{m}" for m in (*modules, "overall"))),
            Panel("TFLOP/s per GPU", tuple(f"perf/tflops_per_gpu/{m}" for m in (*modules, "overall"))),
            Panel("throughput (samples/s)", ("samples_per_s",)),
        )),
        Section("Step time", (
            Panel("step breakdown (s)", ("time/step", "time/data_wait", "time/comm_wait", "time/bubble")),
            Panel("compute per module (s)", tuple(f"time/{m}_compute" for m in modules)),
            Panel("comm wait per module (s)", tuple(f"time/{m}_comm_wait" for m in modules)),
        )),
        Section("DP balance", tuple(
            Panel(f"{m} load per DP rank", tuple(f"balance/{m}_load_{s}" for s in ("max", "min", "mean")))
            for m in balanced
        )),
    )


def graph_dashboard(graph) -> tuple[Section, ...]:
    """The dashboard of a ``ModuleGraph``: its modules' panels, load balance for its encoders and
    generators (the modules whose DP balance the runtime logs), validation loss in total and for
    its LLM and generators; no generation loss without a generator."""
    sections = dashboard(graph.names, graph.encoders + graph.generators,
                         (graph.llm, *graph.generators))
    if graph.generators:
        return sections
    loss = Section("Loss", tuple(p for p in sections[0].panels if p.keys != ("loss/gen",)))
    return (loss, *sections[1:])


DASHBOARD: tuple[Section, ...] = graph_dashboard(ModuleGraph.default())
"""The three-module model's dashboard."""


def workspace_name(graph) -> str:
    """The saved view's name: one per module graph, so runs of different graphs in one project
    keep their own dashboards."""
    return "disttrain-ds: " + " ".join(graph.names)


def dashboard_keys(sections: tuple[Section, ...] = DASHBOARD) -> list[str]:
    """Every metric key the dashboard plots, in display order."""
    return [k for s in sections for p in s.panels for k in p.keys]


def apply_workspace(project: str, entity: str | None = None, name: str = "disttrain-ds",
                    sections: tuple[Section, ...] = DASHBOARD) -> str | None:
    """Save ``sections`` as a saved workspace view of ``entity/project``; returns its URL.

    Returns None with a one-line note on stderr instead of raising when this cannot work:
    WANDB_MODE is offline/disabled, ``wandb-workspaces`` is missing, or the wandb API fails.
    ``entity`` defaults to the logged-in user's default entity.
    """
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun", "disabled"):
        print(f"note: WANDB_MODE={mode}: workspace not saved", file=sys.stderr)
        return None
    try:
        import wandb
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        print(f"note: workspace not saved ({exc}; pip install wandb-workspaces)", file=sys.stderr)
        return None
    try:
        entity = entity or wandb.Api().default_entity
        workspace = ws.Workspace(entity=entity, project=project, name=name, sections=[
            ws.Section(name=s.name, is_open=True, panels=[
                wr.LinePlot(title=p.title, x="Step", y=list(p.keys)) for p in s.panels])
            for s in sections])
        return str(workspace.save().url)
    except Exception as exc:  # network, auth or API drift: the dashboard is optional
        print(f"note: workspace not saved ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None

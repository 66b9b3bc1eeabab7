"""Per-job metrics logging on the logging rank, and merging of per-rank Chrome traces.

:class:`RunLogger` sends every optimizer-step record to three places: ``metrics.jsonl`` in the
run directory (the source of truth, always written), a wandb run (offline by default, files
under ``<run_dir>/wandb/``) and a tqdm progress bar on a terminal. wandb is optional: if it
cannot be imported, started or written to, training goes on with ``metrics.jsonl`` only and
one warning line on stderr. wandb's own terminal output is silenced (``WANDB_SILENT``); the
logger says in one line where its run is.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from disttrain_ds.errors import first_line
from disttrain_ds.metrics.rundir import MetricsWriter
from disttrain_ds.metrics.wandb_workspace import apply_workspace, graph_dashboard, workspace_name
from disttrain_ds.recipe.graph import as_written, graph_of
from disttrain_ds.schedule.timeline import read_trace_events, write_trace_events

WANDB_MODES = ("offline", "online", "disabled")
# wandb's own older spellings of the modes.
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}
# Record keys that are not plotted: ``step`` is wandb's step, ``time`` its timestamp.
_NOT_LOGGED = {"step", "time"}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class LoggerOptions:
    """How a :class:`RunLogger` reports; the recipe's ``logging`` section fills it."""

    project: str = "disttrain-ds"
    """wandb project."""
    name: str = "run"
    """wandb run name (the recipe name)."""
    mode: str = "offline"
    """wandb mode: offline | online | disabled. The WANDB_MODE environment variable wins when set."""
    total_steps: int | None = None
    """Optimizer steps the progress bar counts to; None leaves it open-ended."""
    progress: bool = True
    """Show a tqdm progress bar; it is shown only when stderr is a terminal."""
    out: TextIO | None = None
    """Where :meth:`RunLogger.echo` writes; None: standard output at the time of the call."""
    dashboard: tuple = ()
    """``wandb_workspace.Section``s saved as the project's workspace view when an online run
    starts (the model graph's own dashboard); empty: none."""
    dashboard_name: str = "disttrain-ds"
    """Name of that saved view."""


def resolve_wandb_mode(requested: str, warn: Callable[[str], None] = _stderr) -> str:
    """The wandb mode to use: WANDB_MODE when set, else ``requested``; "disabled" (with a
    warning) when WANDB_MODE holds something wandb would refuse."""
    requested = _MODE_ALIASES.get(requested, requested)
    if requested not in WANDB_MODES:
        raise ValueError(f"wandb mode must be one of {list(WANDB_MODES)}, got {requested!r}")
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if not env:
        return requested
    env = _MODE_ALIASES.get(env, env)
    if env not in WANDB_MODES:
        # wandb itself rejects the variable, so no run could start anyway.
        warn(f"warning: WANDB_MODE={env!r} is not one of {list(WANDB_MODES)}; "
             "wandb disabled, logging to metrics.jsonl only")
        return "disabled"
    return env


def wandb_payload(record: Mapping[str, Any]) -> dict[str, float]:
    """What one step record logs to wandb: its numeric values under their own (namespaced)
    keys, with plain ``loss`` also as ``loss/total`` so all losses share the ``loss/`` section."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_LOGGED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key] = value
    if "loss" in out:
        out["loss/total"] = out["loss"]
    return out


class RunLogger:
    """Writes step records to ``metrics.jsonl``, wandb and a progress bar. Create it on the
    logging rank only; call :meth:`log` once per optimizer step and :meth:`close` at the end
    (or use it as a context manager)."""

    def __init__(self, run_dir: str | Path, options: LoggerOptions | None = None,
                 config: Mapping[str, Any] | None = None,
                 warn: Callable[[str], None] = _stderr) -> None:
        self.run_dir = Path(run_dir)
        self.options = options or LoggerOptions()
        self._warn = warn
        self.wandb_mode = resolve_wandb_mode(self.options.mode, warn)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._writer: MetricsWriter | None = MetricsWriter(self.run_dir)
        self.wandb_run: Any = None
        if self.wandb_mode != "disabled":
            self.wandb_run = self._start_wandb(dict(config or {}))
        self.bar = self._start_bar()  # tqdm bar; None off a terminal or with progress=False
        if self.wandb_run is not None:
            self.echo(f"wandb: {self.wandb_mode} run in {self.run_dir / 'wandb'}")
            self._push_dashboard()

    @classmethod
    def from_recipe(cls, run_dir: str | Path, recipe: Any, resolved: Mapping[str, Any] | None = None,
                    progress: bool = True, warn: Callable[[str], None] = _stderr,
                    out: TextIO | None = None) -> RunLogger:
        """Logger for a :class:`~disttrain_ds.recipe.schema.Recipe`: project, run name, wandb mode and
        step count from the recipe; wandb config is the recipe plus ``resolved`` (world size,
        topology), the same content as ``recipe.yaml``."""
        config = as_written(recipe)
        if resolved:
            config["resolved"] = dict(resolved)
        graph = graph_of(recipe)
        options = LoggerOptions(project=recipe.logging.project, name=recipe.name,
                                mode=recipe.logging.wandb, total_steps=recipe.train.steps,
                                progress=progress, out=out, dashboard=graph_dashboard(graph),
                                dashboard_name=workspace_name(graph))
        return cls(run_dir, options, config, warn)

    @property
    def metrics_path(self) -> Path:
        """The ``metrics.jsonl`` this logger appends to."""
        return self.run_dir / "metrics.jsonl"

    def _start_wandb(self, config: dict[str, Any]) -> Any:
        os.environ.setdefault("WANDB_SILENT", "true")  # no banners; where the run is: one line
        try:
            import wandb

            return wandb.init(project=self.options.project, name=self.options.name,
                              dir=str(self.run_dir), mode=self.wandb_mode, config=config,
                              reinit="create_new")  # never finish a run the caller owns
        except Exception as exc:  # training must go on without wandb
            self._warn(f"warning: wandb unavailable ({first_line(exc)}); "
                       f"logging to {self.metrics_path} only")
            return None

    def _push_dashboard(self) -> None:
        """Save the dashboard to the wandb project (online runs only: an offline run has no
        project to save it to). Failures are one note on stderr; training goes on."""
        if self.wandb_mode != "online" or not self.options.dashboard:
            return

        url = apply_workspace(self.options.project, getattr(self.wandb_run, "entity", None) or None,
                              name=self.options.dashboard_name, sections=self.options.dashboard)
        if url:
            self.echo(f"wandb: dashboard {url}")

    def _start_bar(self) -> Any:
        if not (self.options.progress and sys.stderr.isatty()):
            return None  # a bar in a log file is just noise
        from tqdm import tqdm

        return tqdm(total=self.options.total_steps, unit="step", dynamic_ncols=True)

    def log(self, record: Mapping[str, Any]) -> None:
        """Record one optimizer step; ``record["step"]`` is required."""
        if "step" not in record:
            raise KeyError("step record lacks 'step'")
        if self._writer is None:
            raise RuntimeError("RunLogger.log() after close()")
        step = int(record["step"])
        self._writer.write(dict(record))
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(wandb_payload(record), step=step)
            except Exception as exc:  # e.g. wandb's service died: keep training
                self._warn(f"warning: wandb logging failed ({first_line(exc)}); "
                           f"logging to {self.metrics_path} only from step {step}")
                self._finish_wandb(exit_code=1)
        if self.bar is not None:
            self.bar.update(max(step - self.bar.n, 0))
            self.bar.set_postfix(_bar_postfix(record), refresh=False)

    def echo(self, line: str) -> None:
        """Print a line without breaking the progress bar."""
        out = self.options.out or sys.stdout
        if self.bar is not None:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def _finish_wandb(self, exit_code: int = 0) -> None:
        run, self.wandb_run = self.wandb_run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:
            self._warn(f"warning: wandb finish failed ({first_line(exc)})")

    def close(self, exit_code: int = 0) -> None:
        """Close the bar, finish the wandb run and close ``metrics.jsonl``; safe to call twice."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._finish_wandb(exit_code)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(exit_code=0 if exc_type is None else 1)  # marks the wandb run failed


def _bar_postfix(record: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    if isinstance(record.get("loss"), (int, float)):
        out["loss"] = f"{record['loss']:.4f}"
    if isinstance(record.get("samples_per_s"), (int, float)):
        out["samples/s"] = f"{record['samples_per_s']:.2f}"
    mfu = record.get("perf/mfu/overall")
    if isinstance(mfu, (int, float)) and math.isfinite(mfu):
        out["MFU"] = f"{100 * mfu:.1f}%"  # MFU values are fractions
    return out


# --------------------------------------------------------------------------- traces


def _rank_of(path: Path, position: int) -> int:
    match = re.search(r"rank[_-]?(\d+)", path.stem)
    return int(match.group(1)) if match else position


def merge_chrome_traces(paths: Iterable[str | Path], out: str | Path) -> Path:
    """Merge per-rank Chrome traces into one file for Perfetto, one process track per rank.

    The rank comes from the file name (``rank3.json`` -> 3), else the file's position in
    ``paths``. Events keep their names, categories, times, thread ids and args; their ``pid``
    becomes the rank, so tracks never collide even when OS pids do. A file's own
    ``process_name`` names its track, else "rank N". Raises ValueError naming a bad file.
    """
    files = [Path(p) for p in paths]
    if not files:
        raise ValueError("no trace files to merge")
    ranked = sorted(((_rank_of(p, k), p) for k, p in enumerate(files)), key=lambda rp: rp[0])
    seen: dict[int, Path] = {}
    merged: list[dict] = []
    for rank, path in ranked:
        if rank in seen:
            raise ValueError(f"{path} and {seen[rank]} are both rank {rank}")
        seen[rank] = path
        name = f"rank {rank}"
        for ev in read_trace_events(path):
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                name = str((ev.get("args") or {}).get("name", name))
            elif ev.get("ph") != "M" or ev.get("name") != "process_sort_index":
                merged.append({**ev, "pid": rank})
        merged.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": name}})
        merged.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
    return write_trace_events(merged, out)

"""Offline dashboard for training runs: PNG plots and a summary table from metrics.jsonl.

    disttrain-report runs/tiny_cpu
    disttrain-report runs/monolithic runs/disaggregated --html
    disttrain-report runs/a runs/b --out reports/a_vs_b

(``python tools/report.py ...`` in a checkout is the same command.) Several runs share each
figure (legend: run directory and layout). Writes into --out
(default <first run dir>/report/; a numbered sibling such as report-2 when that one is not
empty, so nothing is overwritten): loss.png (with a validation-loss panel when a run logged
eval/loss), step_time.png, mfu.png and balance.png (when
the runs log those keys), trace_<run>.json and gantt_<run>.png for runs with trace/*.json,
and index.html with --html. Bad input: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disttrain_ds.metrics.rundir import make_run_dir
from disttrain_ds.report.figures import loss_panels, plot_balance, plot_loss, plot_mfu, plot_step_time, plot_traces
from disttrain_ds.report.runs import ReportError, Run, load_runs, module_names
from disttrain_ds.report.summary import format_table, summary_rows, write_html

__all__ = ["ReportError", "Run", "build_parser", "loss_panels", "main", "module_names"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", help="output directory (default: <first run dir>/report)")
    parser.add_argument("--html", action="store_true", help="also write a self-contained index.html")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        runs = load_runs(args.run_dirs)
        requested = Path(args.out) if args.out else runs[0].path / "report"
        if requested.exists() and not requested.is_dir():
            raise ReportError(f"{requested}: exists and is not a directory")
        out = make_run_dir(str(requested), "report")  # never reuses a non-empty directory
        if out != requested:
            print(f"note: {requested} is not empty; writing to {out}", file=sys.stderr)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    pngs = [plot_loss(runs, out), plot_step_time(runs, out), plot_mfu(runs, out), plot_balance(runs, out)]
    pngs = [p for p in pngs if p is not None]
    traces = [p for run in runs for p in plot_traces(run, out)]
    pngs += [p for p in traces if p.suffix == ".png"]
    header, rows = summary_rows(runs)
    print(format_table(header, rows))
    written = pngs + [p for p in traces if p.suffix == ".json"]
    if args.html:
        written.append(write_html(runs, header, rows, pngs, out))
    print(f"\nreport: {out}")
    for p in written:
        print(f"  {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

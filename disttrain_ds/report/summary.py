"""The report's summary table (text and HTML) and its self-contained ``index.html``."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from disttrain_ds.report.runs import Run


def summary_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    header = ["run", "layout", "steps", "final loss", "median s/step", "median samples/s"]
    mfu = any(r.has("perf/mfu/overall") for r in runs)
    if mfu:
        header.append("median MFU")
    evals = any(r.has("eval/loss") for r in runs)
    if evals:
        header.append("final eval loss")
    rows = []
    for r in runs:
        row = [r.name, r.layout, str(r.records[-1]["step"]), f"{r.records[-1]['loss']:.4f}",
               fmt(r.median("step_seconds"), ".3f"), fmt(r.median("samples_per_s"), ".2f")]
        if mfu:
            m = r.median("perf/mfu/overall")
            row.append("-" if m is None else f"{100 * m:.1f}%")
        if evals:
            row.append(fmt((r.series("eval/loss")[1] or [None])[-1], ".4f"))
        rows.append(row)
    return header, rows


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_html(runs: list[Run], header: list[str], rows: list[list[str]], pngs: list[Path], out: Path) -> Path:
    esc = html.escape
    table = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>\n" + "\n".join(
        "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    images = "\n".join(
        f'<h2>{esc(p.stem)}</h2>\n<img alt="{esc(p.name)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">' for p in pngs)
    sources = "".join(f"<li>{esc(r.label)}: <code>{esc(str(r.path.resolve()))}</code></li>" for r in runs)
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>disttrain-ds report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}</style>
</head><body><h1>disttrain-ds report</h1><ul>{sources}</ul>
<table>{table}</table>
{images}
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path

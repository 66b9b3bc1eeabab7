"""The table of a GPU session (``bench/gpu_session.sh``) from the JSON it wrote.

    python bench/gpu_session_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = (("modules_compiled.json", "compiled"), ("modules_docs.json", "compiled"), ("modules_mixed.json", "compiled"),
        ("modules_eager.json", "eager"), ("modules_larger.json", "compiled"))


def session_table(out: Path) -> str:
    """Markdown: every module row of the session's runs, then each step's exit code and time."""
    lines = []
    for name, how in RUNS:
        path = out / name
        if not path.exists():
            lines.append(f"{name}: missing (the step did not finish)")
            continue
        data = json.loads(path.read_text())
        if not lines or not lines[0].startswith("card"):
            card = data.get("card") or {}
            lines.insert(0, f"card: {data['device']}, peak {data['peak_tflops']:g} TFLOP/s, SM clock "
                            f"{card.get('clocks.sm', '?')} (max {card.get('clocks.max.sm', '?')}), power limit "
                            f"{card.get('power.limit', '?')}; bf16 GEMM ceiling {data['gemm_ceiling_tflops']:.0f} "
                            f"TFLOP/s; torch {data.get('torch', '?')}\n")
            lines.insert(1, "| run | module | batch | step ms | MFU causal | MFU full L^2 | tokens/s | peak GiB | note |")
            lines.insert(2, "|---|---|---|---|---|---|---|---|---|")
        for r in data["results"]:
            tok = "-" if r["tokens_per_s"] != r["tokens_per_s"] else f"{r['tokens_per_s']:,.0f}"
            mem = "-" if r["peak_mem_gib"] != r["peak_mem_gib"] else f"{r['peak_mem_gib']:.1f}"
            lines.append(f"| {how}, accum {data['accum']} | {r['module']} | {r['shape']} | {r['step_ms']:.1f} "
                         f"| {r['mfu']:.1%} | {r['mfu_full']:.1%} | {tok} | {mem} | {r['note']} |")
    steps = out / "steps.jsonl"
    if steps.exists():
        lines.append("")
        lines += [f"{s['step']}: exit {s['rc']}, {s['seconds']} s" for s in map(json.loads, steps.read_text().splitlines())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python bench/gpu_session_table.py OUT_DIR")
    print(session_table(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

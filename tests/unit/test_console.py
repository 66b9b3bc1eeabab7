"""``Console``: rank 0's own lines on the terminal, everything else printed to standard output
(Python, DeepSpeed's logger, child processes) in the rank's log, which moves into the run directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from disttrain_ds.runtime.console import Console
    rank, run_dir = int(sys.argv[1]), sys.argv[2]
    console = Console.start(rank)
    print("library print")
    logging.getLogger("DeepSpeed").addHandler(logging.StreamHandler(sys.stdout))
    logging.getLogger("DeepSpeed").warning("deepspeed warning")
    warnings.warn("a library warning")
    subprocess.run(["echo", "child output"], check=True)
    console.say("our line")
    before = str(console.log_path)
    assert console.note().endswith(before + ")")
    console.move_to(run_dir)
    print("after the move")
    console.say("our second line")
    print(before, file=sys.stderr)
    print("failure line", file=sys.stderr)
""")


def _run(rank: int, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(rank), str(run_dir)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_rank0_says_its_lines_and_logs_library_output(tmp_path):
    proc = _run(0, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["our line", "our second line"]
    temp, *rest = proc.stderr.splitlines()
    assert rest == ["failure line"] and not Path(temp).exists()  # the temp log moved
    log = (tmp_path / "logs" / "rank0.log").read_text()
    for text in ("library print", "deepspeed warning", "a library warning", "child output", "our line",
                 "after the move"):
        assert text in log, log


def test_other_ranks_print_nothing_of_their_own(tmp_path):
    proc = _run(2, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "library print" in (tmp_path / "logs" / "rank2.log").read_text()

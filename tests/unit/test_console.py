"""``Console``: rank 0's own lines on the terminal, everything else printed to standard output
(Python, DeepSpeed's logger, child processes) in the rank's log, which moves into the run directory;
failure lines that would repeat another rank's cause go to the log only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from disttrain_ds.console import tell_launcher

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from disttrain_ds.console import Console
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
    console.log("stopping at step 3 because rank 1 failed: the cause")
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
                 "after the move", "because rank 1 failed: the cause"):
        assert text in log, log


def test_other_ranks_print_nothing_of_their_own(tmp_path):
    proc = _run(2, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "library print" in (tmp_path / "logs" / "rank2.log").read_text()


def test_a_logged_failure_line_stays_off_the_terminal(tmp_path):
    proc = _run(2, tmp_path)
    assert "the cause" not in proc.stdout + proc.stderr
    assert "because rank 1 failed: the cause" in (tmp_path / "logs" / "rank2.log").read_text()


def test_a_following_ranks_launcher_line_is_dated_after_the_failed_ranks(tmp_path, monkeypatch):
    stamps = []
    for name, later in (("failed.json", False), ("follower.json", True)):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / name))
        tell_launcher(name, later=later)
        stamps.append(int(json.loads((tmp_path / name).read_text())["message"]["extraInfo"]["timestamp"]))
    assert stamps[1] > stamps[0] and stamps[0] <= time.time()  # torchrun's root cause: the earliest

"""What a multi-process job shows on the terminal: our lines from rank 0, errors from any rank.

Libraries print a lot at start-up, on every rank: DeepSpeed's accelerator note, its logger and the
``print`` calls of its pipeline partitioning (``SEED_LAYERS=...``, per-stage layer lists), wandb's
banners, Python warnings. ``Console.start`` sends this process's standard output (file
descriptor 1, so child processes and C++ code too) and Python warnings to a log file and keeps
the terminal for ``say``: the rank map, ``data: ...``, ``recipe ...``, step lines. Standard error
stays on the terminal for failure lines (``runtime/health.py``); once the log is in the run
directory, a rank whose failure line would repeat another rank's cause writes it to its log
(``log``) instead (``runtime/verdict.py``).

The log starts in the temp directory (``disttrain-rank<N>-*.log``) and moves to
``<run dir>/logs/rank<N>.log`` once the run directory exists; a failure before that names the
temp file (``Console.note``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TextIO

DEEPSPEED_LOGGERS = ("DeepSpeed", "deepspeed")
"""DeepSpeed's logger names (``deepspeed.utils.logging`` creates the first)."""


class Console:
    """The terminal and the library log of one rank."""

    def __init__(self, rank: int, terminal: TextIO, log_path: Path | None = None):
        self.rank = rank
        self.terminal = terminal
        """Where ``say`` writes (the original standard output)."""
        self.log_path = log_path
        """Where library output goes; None when nothing is redirected."""
        self.in_run_dir = False

    @classmethod
    def start(cls, rank: int) -> "Console":
        """Redirect standard output of this process to a temp log; keep the terminal for ``say``."""
        prefer_cpu_accelerator()
        sys.stdout.flush()
        terminal = os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="replace")
        fd, name = tempfile.mkstemp(prefix=f"disttrain-rank{rank}-", suffix=".log")
        os.fchmod(fd, 0o644)  # readable like the rest of the run directory it moves to
        os.dup2(fd, 1)  # fd 1 now appends to the log: Python prints, C++ and children alike
        os.close(fd)
        console = cls(rank, terminal, Path(name))
        console._route_python_output()
        return console

    @classmethod
    def plain(cls, rank: int = 0) -> "Console":
        """No redirection: ``say`` prints to standard output (single-process runs, tests)."""
        return cls(rank, sys.stdout)

    def say(self, line: str) -> None:
        """One of our lines: on the terminal from rank 0 (and into the log)."""
        if self.rank != 0:
            return
        print(line, file=self.terminal, flush=True)
        if self.log_path is not None:
            print(line, flush=True)

    def log(self, line: str) -> None:
        """One line into this rank's log only, never the terminal (nothing without a log)."""
        if self.log_path is None:
            return
        sys.stdout.flush()
        print(line, flush=True)  # fd 1 is the log: in order with what libraries wrote there

    def move_to(self, run_dir: str | Path) -> None:
        """Continue the log as ``<run_dir>/logs/rank<N>.log`` (``rank<N>-2.log``, ... when a resumed
        run's directory already has one), keeping what it holds so far."""
        if self.log_path is None or self.in_run_dir:
            return
        logs, n = Path(run_dir) / "logs", 1
        target = logs / f"rank{self.rank}.log"
        while target.exists():  # a resumed run keeps the logs of the attempts before it
            n += 1
            target = logs / f"rank{self.rank}-{n}.log"
        logs.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        try:
            os.replace(self.log_path, target)  # same file: fd 1 and children keep appending to it
        except OSError:  # another filesystem (or the temp file is gone): copy, then point fd 1 there
            if self.log_path.exists():
                shutil.copyfile(self.log_path, target)
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.close(fd)
            self.log_path.unlink(missing_ok=True)
        self.log_path, self.in_run_dir = target, True

    def discard(self) -> None:
        """Remove the temp log after a recipe error (its one line says everything)."""
        if self.log_path is not None and not self.in_run_dir:
            self.log_path.unlink(missing_ok=True)

    def note(self) -> str:
        """Where to look for library output after a failure; empty once it is in the run directory."""
        if self.log_path is None or self.in_run_dir:
            return ""
        return f" (library output: {self.log_path})"

    def _route_python_output(self) -> None:
        # DeepSpeed's handler holds the sys.stdout object, which still writes to fd 1: the log.
        for name in DEEPSPEED_LOGGERS:
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    handler.setStream(sys.stdout)
        warnings.showwarning = _warning_to_log
        os.environ.setdefault("WANDB_SILENT", "true")


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stdout.write(warnings.formatwarning(message, category, filename, lineno, line))


def prefer_cpu_accelerator() -> None:
    """Without a GPU, tell DeepSpeed it runs on the CPU before it is imported (no detection warning)."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def tell_launcher(line: str, later: bool = False) -> None:
    """Leave ``line`` where torchrun's failure summary reads it: the ``traceback :`` field of its
    ``Root Cause`` block then shows this one line instead of a pointer to its docs. ``later``: the
    line of a rank that only stops because another failed; dated a second on, so the summary, which
    takes the earliest as its root cause, keeps the failed rank's line there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            # torchrun's own format (errors/error_handler.py); it prints "py_callstack".
            info = {"py_callstack": line, "timestamp": str(int(time.time()) + int(later))}
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:
        pass

"""Command-line entry points (``disttrain-train``, ``-plan``, ``-profile``, ``-launch``, ``-report``)
and their shared plumbing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def prog_name(command: str, fallback: str) -> str:
    """``command`` when this process was started as that console command, else ``fallback``."""
    return command if sys.argv and Path(sys.argv[0]).stem == command else fallback

"""The errors the package stops with, each printed as one line: raised on every floor, so they
live on the lowest, with the wording their messages share."""

from __future__ import annotations


def plural(count: int, word: str) -> str:
    """``"1 host"``, ``"2 hosts"``."""
    return f"{count} {word}" + ("" if count == 1 else "s")


_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


class ConfigError(ValueError):
    """A recipe or config file is invalid; the message is one line naming the key and file."""

    def __init__(self, message: object = "", *args: object):
        # Values quoted into messages (paths, strings from the file) may hold line breaks: escape them.
        super().__init__(str(message).translate(_LINE_BREAKS), *args)


class TrainingDiverged(RuntimeError):
    """The loss of a step is NaN or infinite; the message is one line naming the step."""


class CommTimeoutError(RuntimeError):
    """A peer did not send or receive in time (stuck or dead)."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer
        """The global rank that did not answer (the suspect, not the rank that waited)."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of its message`` (the type alone for an empty message)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

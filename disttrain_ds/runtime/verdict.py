"""Who shows a failure's cause on the terminal: one rank per job, plus a pointer on each other host.

When a rank fails, every rank stops with a line naming the cause (``runtime/health.py``). On one
host all ranks share a terminal, so printing every line shows the cause once per rank. Instead the
rank that publishes the verdict (the failed rank itself, or the first rank that finds a silent
peer) prints it; every other rank keeps its line in ``<run dir>/logs/rank<N>.log``. A host that
only shows its own ranks (torchrun started per node) would then show nothing, so on each host
other than the publisher's, its lowest rank prints one short pointer to where the cause is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal, Mapping

Role = Literal["cause", "pointer", "log"]
"""What a rank does with its failure line: print it, print a pointer instead, or only log it."""


@dataclass(frozen=True)
class Verdict:
    """Why the job stops, as every rank reads it from the store."""

    cause: str
    """``rank 2 (llm stage 1 dp 0) failed: ValueError: ...``: the text every rank's line names."""
    failed: int | None
    """The rank that failed; None when it is no rank (the launcher's store)."""
    by: int | None = None
    """The rank that published it; None when nobody could (the store is gone, or not yet tried)."""
    host: str = ""
    """The publisher's host."""
    log: str | None = None
    """The publisher's log in the run directory, where its line (the cause) is kept."""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "Verdict":
        text = raw.decode() if isinstance(raw, bytes) else raw
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):  # not ours: still a reason to stop, with nobody to point at
            return cls(cause=text, failed=None)


def role(v: Verdict, me: int, hosts: Mapping[int, str]) -> Role:
    """``cause`` for the rank that shows ``v`` on the terminal, ``pointer`` for the lowest rank of
    each other host, ``log`` for the rest. ``hosts`` maps ranks to host names (``me`` included);
    a rank whose host is unknown counts as elsewhere, so a gap prints a line too many, never none."""
    if v.by == me:
        return "cause"
    my_host = hosts[me]
    if v.by is not None and v.host == my_host:
        return "log"  # the publisher's line is on this host's terminal already
    here = [r for r, h in hosts.items() if h == my_host and r != v.failed]
    if me != min(here, default=me):
        return "log"
    # Unpublished (the store is gone): each host's lowest rank says the whole line, nobody else can.
    return "cause" if v.by is None else "pointer"


def pointer_line(v: Verdict, me: str, at: str, failed: str, hosts: Mapping[int, str], my_log: str | None) -> str:
    """The short line of a host that does not show the cause: who failed where, and where the
    cause is, without repeating it. ``me`` and ``failed`` are how messages name the two ranks."""
    where = v.log or my_log
    if v.failed is None:
        head = f"rank {v.by} on host {v.host} found a failure"
    else:
        head = f"{failed} on host {hosts.get(v.failed, '?')} failed"
    source = "its output" if v.by in (v.failed, None) else f"the output of rank {v.by} on host {v.host}"
    return f"{me}: stopping{at}: {head}; its cause is in {source}" + (f" and in {where}" if where else "")


def terminal_line(v: Verdict, me: int, hosts: Mapping[int, str], line: str, pointer: str) -> str | None:
    """What this rank prints on the terminal: its full ``line``, the ``pointer``, or nothing."""
    return {"cause": line, "pointer": pointer, "log": None}[role(v, me, hosts)]

"""DeepSpeed hostfiles: parse them and pick the slots the ``deepspeed`` runner would use.

The grammar is DeepSpeed's (``HOST slots=N``, ``#`` comments, blank lines, anything after the
slots token ignored), and slot selection follows its ``--include/--exclude/--num_nodes/--num_gpus``.
Every problem is a one-line ``LaunchError`` naming the hostfile line or the option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from disttrain_ds.errors import ConfigError, plural

_SLOTS = re.compile(r"slots=(\S*)")
_MAX_LISTED = 4  # hosts named in a one-line summary before "+N more"


class LaunchError(ConfigError):
    """A hostfile, launcher option or host is not fit to launch the recipe; one line."""


@dataclass(frozen=True)
class Host:
    """One hostfile entry."""

    name: str
    """Host name or address, as written."""
    slots: int
    """Processes the launcher may start there (GPUs, or CPU ranks)."""
    line: int
    """1-based line number in the hostfile."""


def parse_hostfile_text(text: str, src: str) -> list[Host]:
    """Hosts of a hostfile's text, in file order; ``src`` names the file in errors."""
    hosts: dict[str, Host] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        match = _SLOTS.fullmatch(parts[1]) if len(parts) > 1 else None
        if match is None:
            raise LaunchError(f"{src}:{number}: expected 'HOST slots=N', got {line!r}")
        value = match.group(1).split("#", 1)[0]  # DeepSpeed reads 'slots=8#gpu' as 8
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise LaunchError(f"{src}:{number}: slots must be a positive integer, got 'slots={match.group(1)}'")
        name = parts[0]
        if name in hosts:
            raise LaunchError(f"{src}:{number}: host '{name}' is listed twice (first on line {hosts[name].line})")
        hosts[name] = Host(name, int(value), number)
    if not hosts:
        raise LaunchError(f"{src}: no hosts (empty or only comments); expected lines like 'localhost slots=4'")
    return list(hosts.values())


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read and parse a hostfile; every problem is a one-line ``LaunchError`` naming file (and line)."""
    src = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LaunchError(f"{src}: hostfile not found") from None
    except UnicodeDecodeError:
        raise LaunchError(f"{src}: not a text file") from None
    except OSError as exc:
        raise LaunchError(f"{src}: cannot read hostfile: {exc.strerror or exc}") from None
    return parse_hostfile_text(text, src)


def _parse_filter(spec: str, flag: str, by_name: dict[str, Host], src: str) -> dict[str, list[int]]:
    """``NAME[:SLOT[,SLOT ...]][@NAME...]`` as DeepSpeed reads it: host -> slots named (empty = all)."""
    picked: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, colon, slot_list = part.partition(":")
        if not name or ":" in slot_list or (colon and not slot_list):
            raise LaunchError(f"--{flag} {spec!r}: bad node spec {part!r}; expected NAME[:SLOT[,SLOT...]][@NAME...]")
        if name not in by_name:
            raise LaunchError(f"--{flag} {spec!r}: host '{name}' is not in {src}")
        host, slots = by_name[name], []
        for token in slot_list.split(",") if colon else []:
            if not (token.isascii() and token.isdigit()):
                raise LaunchError(f"--{flag} {spec!r}: slot {token!r} of host '{name}' is not an integer")
            if int(token) >= host.slots:
                have = f"slots 0-{host.slots - 1} ({src}:{host.line})"
                raise LaunchError(f"--{flag} {spec!r}: host '{name}' has {have}, no slot {token}")
            slots.append(int(token))
        picked.setdefault(name, []).extend(slots)
    return {name: sorted(set(slots)) for name, slots in picked.items()}


def select_slots(
    hosts: list[Host],
    *,
    src: str,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
    include: str = "",
    exclude: str = "",
) -> dict[str, list[int]]:
    """Slots the DeepSpeed runner would use, host -> slot ids, in hostfile order."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude (DeepSpeed refuses it)")
    by_name = {h.name: h for h in hosts}
    active = {h.name: list(range(h.slots)) for h in hosts}
    if include:
        picked = _parse_filter(include, "include", by_name, src)
        active = {h.name: picked[h.name] or active[h.name] for h in hosts if h.name in picked}
    elif exclude:
        for name, slots in _parse_filter(exclude, "exclude", by_name, src).items():
            active[name] = [s for s in active[name] if slots and s not in slots]
        active = {name: slots for name, slots in active.items() if slots}
        if not active:
            raise LaunchError(f"--exclude {exclude!r} leaves no slots in {src}")
    if num_nodes is not None:
        if num_nodes < 1:
            raise LaunchError(f"--num_nodes must be >= 1, got {num_nodes}")
        if num_nodes > len(hosts):
            raise LaunchError(f"--num_nodes {num_nodes} but {src} lists {plural(len(hosts), 'host')}")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        if num_gpus < 1:
            raise LaunchError(f"--num_gpus must be >= 1, got {num_gpus}")
        for name in active:
            host = by_name[name]
            if num_gpus > host.slots:
                raise LaunchError(
                    f"--num_gpus {num_gpus} is more than the {plural(host.slots, 'slot')} of host '{name}' ({src}:{host.line})"
                )
            active[name] = list(range(num_gpus))
    return active


def slots_summary(active: dict[str, list[int]]) -> str:
    """``"host-a 4, host-b 4"``: slots used per host, the first few hosts named."""
    items = [f"{name} {len(slots)}" for name, slots in active.items()]
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f", +{more} more hosts" if more > 0 else "")

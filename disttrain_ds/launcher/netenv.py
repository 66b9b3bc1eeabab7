"""The network interfaces of a launch: ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``.

NCCL (the GPU traffic) binds the interfaces ``NCCL_SOCKET_IFNAME`` selects; the project's
bookkeeping group is gloo (``runtime/distributed.py``: step figures, timelines), which binds
``GLOO_SOCKET_IFNAME``, else the address the host name resolves to: on a multi-NIC node possibly
an interface the other nodes cannot reach, or loopback. So with remote hosts:

- a set ``NCCL_SOCKET_IFNAME`` and no ``GLOO_SOCKET_IFNAME``: gloo gets the same interfaces
  (``gloo_from_nccl``), said in one line; the user chose that network, and gloo left alone may
  pick another;
- both must reach the remote ranks. The ``deepspeed`` launcher (``deepspeed/launcher/runner.py``)
  forwards only variables starting with ``MLFLOW``, ``PYTHON``, ``MV2``, ``UCX`` and its
  accelerator's (``NCCL`` on CUDA, none on CPU: as the launching machine sees it), plus the
  ``KEY=VALUE`` lines of ``.deepspeed_env`` in the home directory then the working directory (the
  name from ``DS_ENV_FILE``). ``GLOO_`` is never forwarded. When a variable is missing from those
  files, the launch writes a new file holding their lines plus the missing ones and points
  ``DS_ENV_FILE`` at it; the user's files are left as they are.

Where this machine runs ranks, each set variable must name interfaces it has (``socket.if_nameindex``):
NCCL reads a comma list of name prefixes (``=`` for exact names, a leading ``^`` to exclude);
gloo a comma list of exact names (``torch/csrc/distributed/c10d/init.cpp``). A machine that runs
no ranks (a login node) may name its interfaces otherwise, so nothing is checked there.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Sequence

from disttrain_ds.launcher.hostfile import LaunchError

NCCL = "NCCL_SOCKET_IFNAME"
GLOO = "GLOO_SOCKET_IFNAME"
DS_ENV_FILE = "DS_ENV_FILE"
"""The variable naming DeepSpeed's environment file (its default name: ``DEFAULT_ENV_NAME``)."""
DEFAULT_ENV_NAME = ".deepspeed_env"
_LISTED = 8  # interfaces named in a one-line error before "+N more"


def _entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def nccl_matches(value: str, names: Sequence[str]) -> list[str]:
    """The interfaces among ``names`` that ``NCCL_SOCKET_IFNAME=value`` lets NCCL use (an
    exclusion list leaves loopback out, as NCCL would not carry traffic between hosts on it)."""
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    entries = _entries(body[1:] if exact else body)

    def listed(name: str) -> bool:
        return any(name == e if exact else name.startswith(e) for e in entries)

    return [n for n in names if listed(n) != exclude and not (exclude and n == "lo")]


def gloo_from_nccl(value: str) -> str | None:
    """``GLOO_SOCKET_IFNAME`` for the interfaces ``NCCL_SOCKET_IFNAME=value`` names, or None for
    an exclusion list (gloo takes names, not what to avoid)."""
    if value.startswith("^"):
        return None
    return ",".join(_entries(value.removeprefix("=")))


def interface_problem(var: str, value: str, names: Sequence[str], host: str) -> str | None:
    """Why ``var=value`` names no interface of this machine (``names``), or None."""
    have = ", ".join(names[:_LISTED]) + (f" +{len(names) - _LISTED} more" if len(names) > _LISTED else "")
    if var == GLOO:
        missing = [e for e in _entries(value) if e not in names]
        if missing:
            return (f"{var}={value}: no interface named {', '.join(missing)} on this machine ({host}: {have}); "
                    "gloo takes exact interface names, comma-separated")
        return None
    if not nccl_matches(value, names):
        return (f"{var}={value}: matches no interface of this machine ({host}: {have}); NCCL reads a comma list "
                "of name prefixes, '=' for exact names, a leading '^' to exclude")
    return None


def read_env_files(env: Mapping[str, str], home: str, cwd: str) -> tuple[list[str], dict[str, str], list[str]]:
    """The files DeepSpeed's runner would read (home, then working directory; the name from
    ``DS_ENV_FILE``): their lines, the values they set (a later line wins, as in DeepSpeed), and
    their paths. A line that is not ``KEY=VALUE`` stops DeepSpeed with a traceback: one line here."""
    name = env.get(DS_ENV_FILE, DEFAULT_ENV_NAME)
    paths = list(dict.fromkeys(os.path.realpath(os.path.join(d, name)) for d in (home, cwd)))
    lines, values, found = [], {}, []
    for path in (p for p in paths if os.path.isfile(p)):
        found.append(path)
        with open(path) as f:
            for number, raw in enumerate(f.read().splitlines(), start=1):
                if "=" not in raw:
                    raise LaunchError(f"{path}:{number}: DeepSpeed reads every line as KEY=VALUE, got {raw!r}")
                key, val = raw.split("=", 1)
                lines.append(raw)
                values[key.strip()] = val.strip()
    return lines, values, found


@dataclass
class SocketEnv:
    """What the launch does about the interfaces: its report lines, the variables it sets in the
    launcher's environment, and the DeepSpeed environment file it writes (None: none)."""

    lines: list[str] = field(default_factory=list)
    set_env: dict[str, str] = field(default_factory=dict)
    env_file: str | None = None


def plan_socket_env(env: Mapping[str, str], *, remote: bool, ranks_here: bool, interfaces: Sequence[str] | None,
                    host: str, home: str, cwd: str) -> SocketEnv:
    """What to set, check and forward (module docstring); raises a one-line ``LaunchError``.
    ``remote``: the job has remote hosts; ``ranks_here``: this machine runs ranks; ``interfaces``:
    its interface names (None: unknown)."""
    out = SocketEnv()
    values = {k: env[k].strip() for k in (NCCL, GLOO) if env.get(k, "").strip()}
    derived = remote and NCCL in values and GLOO not in values
    if derived:
        gloo = gloo_from_nccl(values[NCCL])
        if not gloo:
            raise LaunchError(f"{NCCL}={values[NCCL]} excludes interfaces, which gloo cannot take; set {GLOO} to the "
                              "interface the nodes reach each other on (e.g. eth0): the bookkeeping group is gloo")
        values[GLOO] = out.set_env[GLOO] = gloo
        out.lines.append(f"network: {GLOO}={gloo} set from {NCCL} (the bookkeeping group is gloo; unset, it binds "
                         "to the address the host name resolves to)")
    if values and ranks_here and interfaces is not None:
        for var, value in values.items():
            problem = interface_problem(var, value, interfaces, host)
            if problem:
                raise LaunchError(problem + (f" (set from {NCCL})" if derived and var == GLOO else ""))
        out.lines.append(f"network: {', '.join(f'{k}={v}' for k, v in values.items())}: interfaces present here")
    elif values:
        why = "this machine runs no ranks" if not ranks_here else "this machine's interfaces are unknown"
        out.lines.append(f"network: {', '.join(values)} not checked here ({why})")
    if remote and values:
        _forward(env, values, out, home, cwd)
    return out


def _forward(env: Mapping[str, str], values: dict[str, str], out: SocketEnv, home: str, cwd: str) -> None:
    lines, in_files, found = read_env_files(env, home, cwd)
    for key in [k for k in values if k in in_files and in_files[k] != values[k]]:
        out.lines.append(f"network: remote ranks get {key}={in_files[key]} from {', '.join(found)}, not "
                         f"{values[key]}: DeepSpeed's file wins")
    missing = [k for k in values if k not in in_files]
    if not missing:
        out.lines.append(f"network: remote ranks get {', '.join(values)} from {', '.join(found)}")
        return
    out.env_file = "\n".join([*lines, *(f"{k}={values[k]}" for k in missing)]) + "\n"
    copied = f" with the lines of {', '.join(found)} (left as they are)" if found else ""
    out.lines.append(f"network: remote ranks get {', '.join(missing)} through {DS_ENV_FILE}, a new file{copied}: "
                     "the deepspeed launcher does not forward them itself")


def apply_socket_env(plan: SocketEnv, environ: MutableMapping[str, str], *, write: bool) -> list[str]:
    """Set ``plan``'s variables in ``environ`` and write its environment file (``write``; else
    only say what would be done); the report lines."""
    if not write:
        pending = plan.set_env or plan.env_file
        return plan.lines + (["network: dry run: nothing set, no file written"] if pending else [])
    environ.update(plan.set_env)
    if plan.env_file is None:
        return plan.lines
    fd, path = tempfile.mkstemp(prefix="disttrain-deepspeed-env-")  # DeepSpeed reads it at start and at each restart
    with os.fdopen(fd, "w") as f:
        f.write(plan.env_file)
    environ[DS_ENV_FILE] = path
    return plan.lines + [f"network: {DS_ENV_FILE}={path}"]

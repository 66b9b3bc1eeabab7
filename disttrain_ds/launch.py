"""Check a DeepSpeed hostfile against the recipe and the network, then start the ``deepspeed`` launcher.

    disttrain-launch --hostfile H [--num_nodes N] [--num_gpus G] [--include S | --exclude S]
        [--master_port P] [--master_addr A] [--ssh-port 22] [--connect-timeout 5]
        [--skip-reachability] [--dry-run] [--max-restarts N [--restart-delay S]]
        --recipe R.yaml [key=value ...]

(``python tools/launch.py`` in a checkout is the same command; it starts ``tools/train.py`` on every
node, while ``disttrain-launch`` starts the installed ``disttrain_ds.cli.train`` module.)

Left to itself the launcher finds a bad hostfile line with a dump of the whole file, a slot count
that does not match the layout only once every rank has started, and a dead node as an ssh error
or a hang. Here each of those is one line naming the hostfile line, before any process starts.
The recipe is loaded and validated first (and, with ``train.device_memory_gib``, each rank's
estimated peak memory checked), so a recipe error is also one line, the last one printed.
The hostfile grammar is DeepSpeed's (``HOST slots=N``, ``#`` comments, blank lines, anything after
the slots token ignored), and slot selection follows its ``--include/--exclude/--num_nodes/--num_gpus``.
With ``--max-restarts N`` a failed job is relaunched with ``train.resume=auto`` (``supervise.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cli import OneLineParser, prog_name
from .configtools import ConfigError
from .supervise import check_restartable, start

TRAIN_MODULE = "disttrain_ds.cli.train"
"""What every rank runs (``python -m``) when no training script is given."""
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
            raise LaunchError(f"--num_nodes {num_nodes} but {src} lists {_n(len(hosts), 'host')}")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        if num_gpus < 1:
            raise LaunchError(f"--num_gpus must be >= 1, got {num_gpus}")
        for name in active:
            host = by_name[name]
            if num_gpus > host.slots:
                raise LaunchError(
                    f"--num_gpus {num_gpus} is more than the {_n(host.slots, 'slot')} of host '{name}' ({src}:{host.line})"
                )
            active[name] = list(range(num_gpus))
    return active


def required_ranks(recipe) -> tuple[int, str]:
    """Ranks a recipe's layout needs, and the per-module breakdown that explains the number."""
    if recipe.layout == "reference":
        return 1, "reference: one process"
    from .topology import Topology

    topo = Topology.from_recipe(recipe)
    return topo.world_size, " + ".join(f"{m.name} {m.size}" for m in topo.modules)


def check_memory(recipe) -> str:
    """Check each rank's estimated peak against ``train.device_memory_gib`` (a one-line
    ``ConfigError`` naming the rank when one does not fit); the line reporting it. Without that
    field the launching machine says nothing about the nodes: each rank checks at start-up."""
    if recipe.train.device_memory_gib <= 0:
        return "memory: checked by every rank at start-up (set train.device_memory_gib to check here)"
    from .runtime.memory import GIB, check_fits, estimate, per_rank_totals

    rows = estimate(recipe)
    check_fits(recipe, rows, recipe.train.device_memory_gib, "train.device_memory_gib")
    totals = per_rank_totals(rows)
    worst = max(totals, key=totals.get)
    return (f"memory: estimated peak {totals[worst] / GIB:.1f} GiB (rank {worst}) of "
            f"{recipe.train.device_memory_gib:g} GiB per device: fits")


def tp_span_problems(recipe, active: dict[str, list[int]]) -> list[str]:
    """TP groups whose ranks the launcher puts on more than one host (ranks go host by host in
    hostfile order, as DeepSpeed's runner assigns them): "module ranks a-b (host x, host y)"."""
    if recipe.layout == "reference":
        return []
    from .topology import Topology

    host_of = [name for name, slots in active.items() for _ in slots]
    out = []
    for m in Topology.from_recipe(recipe).modules:
        for group in m.tp_groups() if m.tp > 1 else ():
            hosts = list(dict.fromkeys(host_of[r] for r in group if r < len(host_of)))
            if len(hosts) > 1:
                out.append(f"{m.name} ranks {group[0]}-{group[-1]} ({', '.join(hosts)})")
    return out


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _summary(active: dict[str, list[int]]) -> str:
    items = [f"{name} {len(slots)}" for name, slots in active.items()]
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f", +{more} more hosts" if more > 0 else "")


def check_slots(
    hosts: list[Host],
    active: dict[str, list[int]],
    *,
    src: str,
    ranks: int,
    breakdown: str,
    layout: str,
    recipe_src: str,
    filtered: bool,
) -> None:
    """Raise unless the slots used equal the ranks the layout needs; the message suggests a fix."""
    used = sum(len(slots) for slots in active.values())
    if used == ranks:
        return
    if len(hosts) == 1 and not filtered:
        fix = f"set '{hosts[0].name} slots={ranks}' on {src}:{hosts[0].line}"
    elif filtered:
        fix = f"change --num_nodes/--num_gpus/--include/--exclude or {src} so that {ranks} slots are used"
    else:
        fix = f"make the slots in {src} add up to {ranks} (or pick them with --num_nodes/--num_gpus/--include)"
    other = "choose a distributed layout" if layout == "reference" else "change the recipe's parallel.* degrees"
    raise LaunchError(
        f"{src}: {_n(used, 'slot')} used ({_summary(active)}) but layout '{layout}' of {recipe_src} needs "
        f"{_n(ranks, 'rank')} ({breakdown}); {fix}, or {other}"
    )


def local_names() -> frozenset[str]:
    """Names that mean this machine: no network check is needed for them."""
    names = {"localhost", "127.0.0.1", "::1"}
    for lookup in (socket.gethostname, socket.getfqdn):
        try:
            names.add(lookup())
        except OSError:
            pass
    return frozenset(names)


def probe(host: str, port: int, timeout: float) -> str | None:
    """None if ``host`` accepts a TCP connection on ``port`` within ``timeout`` s, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror:
        return "does not resolve (check the name, DNS or /etc/hosts)"
    except TimeoutError:
        return f"is unreachable: no answer on port {port} within {timeout:g} s"
    except ConnectionRefusedError:
        return f"is unreachable: connection to port {port} refused (is sshd running there?)"
    except OSError as exc:
        return f"is unreachable: port {port}: {exc.strerror or exc}"


def check_reachability(
    hosts: list[Host], *, src: str, port: int, timeout: float, local: frozenset[str] | None = None
) -> list[str]:
    """Probe every non-local host at once; one message per host that failed, in hostfile order."""
    local = local_names() if local is None else local
    remote = [h for h in hosts if h.name not in local]
    results: dict[str, str | None] = {}

    def worker(host: Host) -> None:
        results[host.name] = probe(host.name, port, timeout)

    # daemon threads: a name lookup that hangs must not keep the process alive after we give up on it
    threads = [threading.Thread(target=worker, args=(h,), daemon=True) for h in remote]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout + 2  # connect timeout plus slack for name lookup
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    problems = []
    for h in remote:
        reason = results.get(h.name, f"is unreachable: no answer within {2 * timeout + 2:g} s (name lookup hung?)")
        if reason is not None:
            problems.append(f"{src}:{h.line}: host '{h.name}' {reason}")
    return problems


def launcher_prefix() -> list[str]:
    """The ``deepspeed`` launcher of this environment (beside the interpreter), else the runner module."""
    script = Path(sys.executable).parent / "deepspeed"  # no resolve(): a venv's python is a symlink
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def _display_path(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def launcher_command(args, *, all_local: bool, train_script: Path | None = None) -> list[str]:
    """The exact command that starts the job under the ``deepspeed`` launcher; without
    ``train_script`` every rank runs the installed ``TRAIN_MODULE``."""
    cmd = launcher_prefix() + ["--hostfile", args.hostfile]
    for flag in ("num_nodes", "num_gpus", "include", "exclude", "master_port"):
        value = getattr(args, flag)
        if value not in (None, ""):
            cmd += [f"--{flag}", str(value)]
    if args.master_addr:
        cmd += ["--master_addr", args.master_addr]
    elif all_local:
        cmd += ["--master_addr", "127.0.0.1"]  # otherwise DeepSpeed asks the first host over ssh
    if all_local:
        cmd.append("--no_ssh_check")  # a hostfile makes DeepSpeed ssh even to localhost
    elif args.ssh_port != 22:
        cmd += ["--ssh_port", str(args.ssh_port)]
    target = ["--module", TRAIN_MODULE] if train_script is None else [_display_path(train_script)]
    return cmd + target + ["--recipe", args.recipe, *args.overrides]


def _parser() -> OneLineParser:
    p = OneLineParser(prog=prog_name("disttrain-launch", "launch.py"), description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", "-H", required=True, help="DeepSpeed hostfile: lines 'HOST slots=N'")
    p.add_argument("--recipe", required=True, help="shipped recipe name (e.g. tiny_cpu) or recipe YAML path")
    p.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts (as deepspeed)")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=None, help="use slots 0..G-1 on each host")
    p.add_argument("--include", "-i", default="", help="NAME[:SLOT[,SLOT...]][@...]: use only these (as deepspeed)")
    p.add_argument("--exclude", "-e", default="", help="NAME[:SLOT[,SLOT...]][@...]: leave these out (as deepspeed)")
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port, passed to deepspeed")
    p.add_argument("--master_addr", default="", help="rendezvous address (default 127.0.0.1 for local-only jobs)")
    p.add_argument("--ssh-port", type=int, default=22, help="port probed on remote hosts (default 22)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds per host probe (default 5)")
    p.add_argument("--skip-reachability", action="store_true", help="do not probe remote hosts")
    p.add_argument("--dry-run", action="store_true", help="run the checks, print the command, do not launch")
    p.add_argument("--max-restarts", type=int, default=0, help="relaunch a failed job up to N times (train.resume=auto)")
    p.add_argument("--restart-delay", type=float, default=0.0, help="seconds to wait before each restart (default 0)")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. layout=disaggregated")
    return p


def prepare(args, train_script: Path | None = None) -> tuple[list[str], list[str]]:
    """Run every check; return the lines reporting them and the launcher command."""
    from .config import load_recipe

    if not 1 <= args.ssh_port <= 65535:
        raise LaunchError(f"--ssh-port must be 1-65535, got {args.ssh_port}")
    if args.connect_timeout <= 0:
        raise LaunchError(f"--connect-timeout must be > 0, got {args.connect_timeout:g}")
    if train_script is not None and not train_script.is_file():
        raise LaunchError(f"{train_script}: training script not found")
    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe is the first thing reported
    ranks, breakdown = required_ranks(recipe)
    memory = check_memory(recipe)
    restarts = check_restartable(recipe, args.max_restarts, args.restart_delay)
    src = args.hostfile
    hosts = parse_hostfile(src)
    active = select_slots(
        hosts, src=src, num_nodes=args.num_nodes, num_gpus=args.num_gpus, include=args.include, exclude=args.exclude
    )
    filtered = bool(args.include or args.exclude) or args.num_nodes is not None or args.num_gpus is not None
    check_slots(
        hosts,
        active,
        src=src,
        ranks=ranks,
        breakdown=breakdown,
        layout=recipe.layout,
        recipe_src=args.recipe,
        filtered=filtered,
    )
    used = [h for h in hosts if h.name in active]
    local = local_names()
    remote = [h for h in used if h.name not in local]
    report = [
        f"hostfile {src}: {_n(len(used), 'host')}, {_n(ranks, 'slot')} used ({_summary(active)})",
        f"recipe {args.recipe}: layout {recipe.layout} needs {_n(ranks, 'rank')} ({breakdown}): matches",
        memory,
    ] + [restarts] * bool(restarts)
    spans = tp_span_problems(recipe, active)
    if spans:
        more = f" and {len(spans) - 1} more" if len(spans) > 1 else ""
        report.append(f"warning: {_n(len(spans), 'tensor-parallel group')} span hosts, so their all-reduces leave "
                      f"the node: {spans[0]}{more}; plan with disttrain-plan (it keeps TP groups inside a node) "
                      "or give every host a multiple of the TP degrees' slots")
    if not remote:
        report.append("reachability: every host is this machine, nothing to probe")
    elif args.skip_reachability:
        report.append(f"reachability: skipped for {_n(len(remote), 'remote host')} (--skip-reachability)")
    else:
        problems = check_reachability(used, src=src, port=args.ssh_port, timeout=args.connect_timeout, local=local)
        if problems:
            extra = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
            raise LaunchError(problems[0] + extra)
        report.append(f"reachability: {_n(len(remote), 'remote host')} answered on port {args.ssh_port}")
    return report, launcher_command(args, all_local=not remote, train_script=train_script)


def main(argv: list[str] | None = None, *, train_script: Path | None = None) -> int:
    """Check, then replace this process with the launcher (supervise it with ``--max-restarts``; only
    print the command on --dry-run); ``train_script``: what each rank runs (default: ``TRAIN_MODULE``)."""
    args = _parser().parse_intermixed_args(argv)
    try:
        report, cmd = prepare(args, train_script)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report))
    print("command: " + shlex.join(cmd), flush=True)
    if args.dry_run:
        print("dry run: not launching")
        return 0
    return start(cmd, args.max_restarts, args.restart_delay)

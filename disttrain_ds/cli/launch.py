"""Check a DeepSpeed hostfile against the recipe and the network, then start the ``deepspeed`` launcher.

    disttrain-launch --hostfile H [--num_nodes N] [--num_gpus G] [--include S | --exclude S]
        [--master_port P] [--master_addr A] [--ssh-port 22] [--connect-timeout 5]
        [--skip-reachability] [--dry-run] [--max-restarts N [--restart-delay S] [--elastic PROFILE]]
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
With ``--max-restarts N`` a failed job is relaunched with ``train.resume=auto`` (``launcher/supervise.py``);
with ``--elastic PROFILE`` too, a relaunch that finds fewer slots (a node gone from the hostfile or not
answering) re-plans the recipe for the slots left from that planner profile (``launcher/elastic.py``).
``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` are checked against this machine's interfaces, the
second set from the first for a multi-host job, and both passed to remote ranks, which the
``deepspeed`` launcher does not do for gloo's (``launcher/netenv.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Callable

from disttrain_ds.cli import OneLineParser, prog_name
from disttrain_ds.cost.profile_file import load_profile
from disttrain_ds.errors import ConfigError, plural
from disttrain_ds.launcher.elastic import ElasticPlan, count, include_spec
from disttrain_ds.launcher.hostfile import Host, LaunchError, parse_hostfile, select_slots, slots_summary
from disttrain_ds.launcher.layout_fit import check_memory, check_slots, required_ranks, tp_span_problems
from disttrain_ds.launcher.netenv import SocketEnv, apply_socket_env, plan_socket_env
from disttrain_ds.launcher.reachability import check_reachability, local_names, unreachable
from disttrain_ds.launcher.supervise import check_restartable, resume_command, start
from disttrain_ds.planner.recipe_plan import profile_problem
from disttrain_ds.recipe.graph import graph_of, parallel_key
from disttrain_ds.recipe.schema import Recipe, load_recipe

__all__ = ["Host", "LaunchError", "TRAIN_MODULE", "check_reachability", "launcher_command", "local_names",
           "main", "parse_hostfile", "prepare", "select_slots"]

TRAIN_MODULE = "disttrain_ds.cli.train"
"""What every rank runs (``python -m``) when no training script is given."""


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


def launcher_command(args: argparse.Namespace, *, all_local: bool, train_script: Path | None = None) -> list[str]:
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
    p.add_argument("--elastic", type=Path, default=None, metavar="PROFILE",
                   help="with --max-restarts: re-plan for the slots left after a failure, from this planner profile")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. layout=disaggregated")
    return p


def _check_options(args: argparse.Namespace, train_script: Path | None) -> None:
    if not 1 <= args.ssh_port <= 65535:
        raise LaunchError(f"--ssh-port must be 1-65535, got {args.ssh_port}")
    if args.connect_timeout <= 0:
        raise LaunchError(f"--connect-timeout must be > 0, got {args.connect_timeout:g}")
    if train_script is not None and not train_script.is_file():
        raise LaunchError(f"{train_script}: training script not found")


def _tp_span_warning(recipe, active: dict[str, list[int]]) -> list[str]:
    out = []
    spans = tp_span_problems(recipe, active)
    if spans:
        more = f" and {len(spans) - 1} more" if len(spans) > 1 else ""
        out.append(f"warning: {plural(len(spans), 'tensor-parallel group')} span hosts, so their all-reduces leave "
                   f"the node: {spans[0]}{more}; plan with disttrain-plan (it keeps TP groups inside a node) "
                   "or give every host a multiple of the TP degrees' slots")
    spans = tp_span_problems(recipe, active, "sp")
    if spans:
        more = f" and {len(spans) - 1} more" if len(spans) > 1 else ""
        out.append(f"warning: {plural(len(spans), 'sequence-parallel group')} span hosts, so their all-to-alls "
                   f"leave the node: {spans[0]}{more}; give every host a multiple of the LLM's tp x sp slots")
    return out


def _reachability_line(args: argparse.Namespace, used: list[Host], remote: list[Host], local: frozenset[str]) -> str:
    if not remote:
        return "reachability: every host is this machine, nothing to probe"
    if args.skip_reachability:
        return f"reachability: skipped for {plural(len(remote), 'remote host')} (--skip-reachability)"
    problems = check_reachability(used, src=args.hostfile, port=args.ssh_port, timeout=args.connect_timeout,
                                  local=local)
    if problems:
        extra = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise LaunchError(problems[0] + extra)
    return f"reachability: {plural(len(remote), 'remote host')} answered on port {args.ssh_port}"


def _select(args: argparse.Namespace, hosts: list[Host]) -> dict[str, list[int]]:
    """The slots the user's selection flags pick from ``hosts``."""
    return select_slots(hosts, src=args.hostfile, num_nodes=args.num_nodes, num_gpus=args.num_gpus,
                        include=args.include, exclude=args.exclude)


def _elastic(args: argparse.Namespace, recipe: Recipe, ranks: int, active: dict[str, list[int]],
             train_script: Path | None) -> tuple[str, Callable[[list[str]], list[str]]]:
    """The report line of ``--elastic`` and the supervisor's relaunch: the hostfile read and the
    remote hosts probed again, and a re-plan when slots were lost (``launcher/elastic.py``)."""
    if args.max_restarts <= 0:
        raise LaunchError("--elastic re-plans when the job restarts: give --max-restarts N (N > 0) too")
    profile = load_profile(args.elastic)
    graph = graph_of(recipe)
    why = profile_problem(profile, recipe, args.elastic)
    if why:
        raise LaunchError(why)
    graph_form = parallel_key(recipe, graph.llm).startswith("parallel.modules.")
    plan = ElasticPlan(args.recipe, list(args.overrides), profile, graph_form, active, ranks, [])

    def relaunch(cmd: list[str]) -> list[str]:
        hosts = parse_hostfile(args.hostfile)
        now = _select(args, hosts)
        local = local_names()
        lost = {} if args.skip_reachability else unreachable(
            [h for h in hosts if h.name in now], port=args.ssh_port, timeout=args.connect_timeout, local=local)
        step = plan.next(now, set(lost))
        if not step.line:
            return cmd  # every slot still there: the same command
        print(step.line, file=sys.stderr, flush=True)
        again = argparse.Namespace(**{**vars(args), "include": include_spec(step.slots), "exclude": "",
                                      "num_nodes": None, "num_gpus": None,
                                      "overrides": [*args.overrides, *step.layout]})
        return resume_command(launcher_command(again, all_local=all(h in local for h in step.slots),
                                               train_script=train_script))

    line = (f"elastic: a restart that finds fewer than {plural(ranks, 'slot')} re-plans the recipe for the slots "
            f"left from {args.elastic} ({plural(count(active), 'slot')} selected now)")
    return line, relaunch


def _interfaces() -> list[str] | None:
    """This machine's network interface names, or None where it cannot tell."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return None


def prepare(args: argparse.Namespace, train_script: Path | None = None
            ) -> tuple[list[str], list[str], SocketEnv, Callable[[list[str]], list[str]] | None]:
    """Run every check; return the lines reporting them, the launcher command, what to set in its
    environment (``apply_socket_env``), and the supervisor's relaunch under ``--elastic`` (else None)."""
    _check_options(args, train_script)
    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe is the first thing reported
    ranks, breakdown = required_ranks(recipe)
    memory = check_memory(recipe)
    restarts = check_restartable(recipe, args.max_restarts, args.restart_delay)
    src = args.hostfile
    hosts = parse_hostfile(src)
    active = _select(args, hosts)
    filtered = bool(args.include or args.exclude) or args.num_nodes is not None or args.num_gpus is not None
    check_slots(hosts, active, src=src, ranks=ranks, breakdown=breakdown, layout=recipe.layout,
                recipe_src=args.recipe, filtered=filtered)
    used = [h for h in hosts if h.name in active]
    local = local_names()
    remote = [h for h in used if h.name not in local]
    net = plan_socket_env(os.environ, remote=bool(remote), ranks_here=len(remote) < len(used),
                          interfaces=_interfaces(), host=socket.gethostname(), home=os.path.expanduser("~"),
                          cwd=os.getcwd())
    report = [
        f"hostfile {src}: {plural(len(used), 'host')}, {plural(ranks, 'slot')} used ({slots_summary(active)})",
        f"recipe {args.recipe}: layout {recipe.layout} needs {plural(ranks, 'rank')} ({breakdown}): matches",
        memory,
        *([restarts] if restarts else []),
        *_tp_span_warning(recipe, active),
        _reachability_line(args, used, remote, local),
    ]
    relaunch = None
    if args.elastic is not None:
        line, relaunch = _elastic(args, recipe, ranks, active, train_script)
        report.append(line)
    return report, launcher_command(args, all_local=not remote, train_script=train_script), net, relaunch


def main(argv: list[str] | None = None, *, train_script: Path | None = None) -> int:
    """Check, then replace this process with the launcher (supervise it with ``--max-restarts``; only
    print the command on --dry-run); ``train_script``: what each rank runs (default: ``TRAIN_MODULE``)."""
    args = _parser().parse_intermixed_args(argv)
    try:
        report, cmd, net, relaunch = prepare(args, train_script)
        report += apply_socket_env(net, os.environ, write=not args.dry_run)  # what the launcher inherits
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write the DeepSpeed environment file: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print("\n".join(report))
    print("command: " + shlex.join(cmd), flush=True)
    if args.dry_run:
        print("dry run: not launching")
        return 0
    return start(cmd, args.max_restarts, args.restart_delay, relaunch)


if __name__ == "__main__":
    sys.exit(main())

"""``disttrain-launch --max-restarts N``: run the launch command as a child and relaunch it from the
newest intact checkpoint when it fails, as ``torchrun --max-restarts`` does (the ``deepspeed``
launcher has no restart option).

A relaunch appends ``train.resume=auto`` to the recipe overrides (replacing any ``train.resume=``
given), so it continues from the newest intact checkpoint in ``checkpoint.dir``. Never restarted:
exit 0; exit 2 (bad input: a recipe, override or checkpoint error fails the same way every time);
exit 143 (SIGTERM: the job saved a checkpoint and stopped on purpose) and 130 (SIGINT); a child
killed by signal N counts as 128 + N. When the supervisor itself gets SIGINT, SIGTERM or SIGHUP
(a closed terminal: the job, in a session of its own, would not get it) it sends the signal on to
the child's process group (launcher, ranks, data producers), waits for the group, and stops; a
second signal kills the group. One line per restart and one final line saying why it stopped go to
stderr; the exit code is the last attempt's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Callable, Sequence

from disttrain_ds.checkpoint.lock import JOB_ENV
from disttrain_ds.errors import ConfigError
from disttrain_ds.runtime.preempt import EXIT_PREEMPTED

if TYPE_CHECKING:  # annotations only; loading a recipe is not this module's business
    from disttrain_ds.recipe.schema import Recipe

EXIT_BAD_INPUT = 2
"""A one-line recipe, override, hostfile or checkpoint error (``tools/train.py``, ``disttrain-launch``)."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT: someone interrupted the job on purpose."""
RESUME_KEY = "train.resume"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals to the supervisor that are sent on to the job and end the restarts."""
GROUP_GRACE_S = 60.0
"""After an interrupt: how long the job's processes may take to exit once the launcher has (the
deepspeed launcher itself kills its ranks 30 s after SIGTERM), before the group is killed."""
STRAY_GRACE_S = 5.0
"""After a failed attempt: how long leftovers of it may take to exit before they are killed (a
stray rank must not write into ``checkpoint.dir`` while the next attempt runs)."""

ATTEMPT_ENV = "DISTTRAIN_LAUNCH_ATTEMPT"
"""0 for the first launch, N for the N-th restart (the supervisor's counterpart of torchrun's
``TORCHELASTIC_RESTART_COUNT``; fault injection in tests reads it)."""


def exit_status(returncode: int) -> int:
    """A shell's view of a child's return code: killed by signal N (``-N``) is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def should_restart(exit_code: int, attempt: int, max_restarts: int, interrupted: bool) -> tuple[bool, str]:
    """Whether to relaunch after an attempt ended with ``exit_code`` (a return code: ``-N`` = signal
    N), ``attempt`` restarts having been made; the reason, as the line to print."""
    code = exit_status(exit_code)
    if interrupted:
        why = "disttrain-launch was interrupted (the signal was sent on to the job)"
    elif code == 0:
        return False, f"finished after {_n(attempt, 'restart')}"
    elif code == EXIT_BAD_INPUT:
        why = "exit code 2 means bad input (recipe, override or checkpoint), which fails the same way again"
    elif code == EXIT_PREEMPTED:
        why = "exit code 143 means the job got SIGTERM (preempted), saved a checkpoint and stopped on purpose"
    elif code == EXIT_INTERRUPTED:
        why = "exit code 130 means the job was interrupted (SIGINT) on purpose"
    elif attempt >= max_restarts:
        why = f"{_n(max_restarts, 'restart')} used (--max-restarts {max_restarts})"
    else:
        return True, (f"restart {attempt + 1}/{max_restarts} after exit code {code} "
                      "(resuming from the newest checkpoint)")
    return False, f"not restarting: {why}; exit code {code}"


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _is_resume(arg: str) -> bool:
    key, eq, _ = arg.partition("=")
    return bool(eq) and key.strip() == RESUME_KEY  # the override parser strips the key too


def resume_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` with every ``train.resume=...`` override dropped and ``train.resume=auto`` appended
    (last, so it wins over the recipe file); applying it again changes nothing."""
    return [arg for arg in cmd if not _is_resume(arg)] + [f"{RESUME_KEY}=auto"]


def check_restartable(recipe: Recipe, max_restarts: int, delay: float) -> str:
    """The report line for ``--max-restarts``; a one-line ``ConfigError`` when it cannot help.

    A recipe whose checkpoints are off, or whose only checkpoint comes after the last step, is
    refused rather than warned about: every restart would start over from step 0 in a new run
    directory, repeating (up to N times) work the user asked to keep, and a warning scrolls away
    in a long job's output. The fix is one override (``checkpoint.every=K``).
    """
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if delay < 0:
        raise ConfigError(f"--restart-delay must be >= 0, got {delay:g}")
    if max_restarts == 0:
        return ""
    every, steps = recipe.checkpoint.every, recipe.train.steps
    flag = f"--max-restarts {max_restarts}"
    if recipe.layout == "reference":
        raise ConfigError(f"{flag}: layout 'reference' writes no checkpoints, so a restart would start over from "
                          "step 0; choose the monolithic or disaggregated layout")
    if every == 0:
        raise ConfigError(f"{flag}: checkpoint.every is 0 (checkpoints off), so a restart would start over from "
                          "step 0; set checkpoint.every=K (steps between checkpoints)")
    if every >= steps:
        raise ConfigError(f"{flag}: checkpoint.every={every} is not below train.steps={steps}, so the only checkpoint "
                          "comes after the last step and a restart would start over from step 0; "
                          "set checkpoint.every below train.steps")
    wait = f", {delay:g} s apart" if delay else ""
    return (f"restarts: up to {max_restarts} after a failure{wait} (not after exit 2 or 143), each with "
            f"{RESUME_KEY}=auto (checkpoint.every={every})")


def _interrupted(interrupts: list[int], code: int, before: int = 0) -> str:
    try:
        name = signal.Signals(interrupts[0]).name
    except ValueError:
        name = f"signal {interrupts[0]}"
    when = f" before restart {before}" if before else " (sent on to the job)"
    return f"not restarting: disttrain-launch got {name}{when}; exit code {exit_status(code)}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_orphans() -> None:
    """As PID 1 (a container without an init), reap the group's processes reparented to us: their
    zombies would keep the group alive. Every child we started has been waited for already."""
    if os.getpid() != 1:
        return
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(pgid: int, grace_s: float, interrupts: list[int]) -> None:
    """Wait up to ``grace_s`` for the processes of group ``pgid`` to exit, then kill what is left
    (at once if another signal arrives meanwhile)."""
    seen, deadline = len(interrupts), time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline and len(interrupts) == seen:
        _reap_orphans()
        time.sleep(0.1)
    if _group_alive(pgid):
        _killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _group_alive(pgid) and time.monotonic() < deadline:
            _reap_orphans()
            time.sleep(0.05)


def supervise(
    cmd: Sequence[str],
    max_restarts: int,
    delay: float = 0.0,
    *,
    say: Callable[[str], None] | None = None,
    relaunch: Callable[[list[str]], list[str]] | None = None,
) -> int:
    """Run ``cmd`` in a process group of its own; relaunch it with ``train.resume=auto`` after a
    failure, up to ``max_restarts`` times. Returns the last exit status (128 + N for signal N).

    ``relaunch`` (``--elastic``): the command of each restart, given the resumed one, after the
    delay; a ``ConfigError`` from it (no layout runs on what is left) ends the restarts with its line."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    interrupts: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, _frame) -> None:
        interrupts.append(signum)
        if child is not None:  # the first signal is passed on; a second one kills the job
            _killpg(child.pid, signum if len(interrupts) == 1 else signal.SIGKILL)

    handlers = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        attempt, cmd = 0, list(cmd)
        # Every attempt is one job: its rank 0 takes the job's directory locks back at once (checkpoint/lock.py).
        job = {JOB_ENV: os.environ.get(JOB_ENV) or uuid.uuid4().hex}
        while True:
            try:
                child = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **job, ATTEMPT_ENV: str(attempt)})
            except OSError as exc:
                say(f"error: cannot start {cmd[0]}: {exc.strerror or exc}")
                return EXIT_BAD_INPUT
            if interrupts:  # a signal that came before the child existed
                _killpg(child.pid, interrupts[-1])
            code = child.wait()  # the handler runs in between; the wait resumes (PEP 475)
            end_group(child.pid, GROUP_GRACE_S if interrupts else STRAY_GRACE_S, interrupts)
            restart, reason = should_restart(code, attempt, max_restarts, bool(interrupts))
            if interrupts:
                reason = _interrupted(interrupts, code)
            if not restart:
                break
            say(reason)
            attempt, cmd = attempt + 1, resume_command(cmd)
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not interrupts:
                time.sleep(min(0.1, delay))
            if interrupts:
                reason = _interrupted(interrupts, code, before=attempt)
                break
            if relaunch is not None:
                try:
                    cmd = relaunch(cmd)
                except ConfigError as exc:
                    reason = f"not restarting: {exc}; exit code {exit_status(code)}"
                    break
        if exit_status(code) != 0 or attempt > 0:
            say(reason)
        return exit_status(code)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def start(cmd: list[str], max_restarts: int, delay: float,
          relaunch: Callable[[list[str]], list[str]] | None = None) -> int:
    """Start the launch command: without restarts replace this process with it (as before
    ``--max-restarts`` existed), else supervise it (``relaunch``: see ``supervise``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if max_restarts > 0:
        return supervise(cmd, max_restarts, delay, relaunch=relaunch)
    try:
        os.execv(cmd[0], cmd)
    except OSError as exc:
        print(f"error: cannot start {cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0  # not reached: execv does not return

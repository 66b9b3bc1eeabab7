"""``disttrain-launch --max-restarts``: when to restart, the relaunch command, and the supervisor
loop run on small fake launch commands (the real launcher: tests/multiproc/test_restart.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from disttrain_ds.errors import ConfigError
from disttrain_ds.launcher import supervise
from disttrain_ds.launcher.supervise import check_restartable, resume_command, should_restart
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


# --- the decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [1, 3, 9, 134, 137, 247, -9, -6])
def test_a_failure_is_restarted_while_restarts_are_left(code):
    restart, line = should_restart(code, 0, 2, False)
    shown = 128 - code if code < 0 else code
    assert restart and line == f"restart 1/2 after exit code {shown} (resuming from the newest checkpoint)"
    restart, line = should_restart(code, 1, 2, False)
    assert restart and line.startswith(f"restart 2/2 after exit code {shown} ")


@pytest.mark.parametrize("code, phrase", [
    (0, "finished after 1 restart"),
    (2, "exit code 2 means bad input"),
    (143, "exit code 143 means the job got SIGTERM (preempted)"),
    (-15, "exit code 143 means the job got SIGTERM"),  # the launcher itself killed by SIGTERM
    (130, "exit code 130 means the job was interrupted (SIGINT)"),
    (-2, "exit code 130"),
])
def test_success_bad_input_preemption_and_interrupts_are_never_restarted(code, phrase):
    restart, line = should_restart(code, 1, 5, False)
    assert not restart and phrase in line


def test_no_restart_past_the_limit():
    assert should_restart(1, 2, 2, False) == (False, "not restarting: 2 restarts used (--max-restarts 2); exit code 1")
    assert should_restart(-9, 1, 1, False)[1] == "not restarting: 1 restart used (--max-restarts 1); exit code 137"


def test_no_restart_after_the_supervisor_was_interrupted():
    restart, line = should_restart(1, 0, 3, True)
    assert not restart and line.startswith("not restarting: disttrain-launch was interrupted")
    assert line.endswith("exit code 1")


# --- the relaunch command -------------------------------------------------------------------------

CMD = ["deepspeed", "--hostfile", "hf", "tools/train.py", "--recipe", "r.yaml", "train.steps=6"]


def test_resume_override_is_appended_once():
    once = resume_command(CMD)
    assert once == [*CMD, "train.resume=auto"]
    assert resume_command(once) == once  # the second restart does not add another


@pytest.mark.parametrize("given", ["train.resume=none", "train.resume=/ckpt/step_00000004", " train.resume =none"])
def test_an_explicit_resume_override_is_replaced(given):
    cmd = CMD[:-1] + [given, "train.steps=6"]
    assert resume_command(cmd) == [*CMD, "train.resume=auto"]


def test_other_resume_looking_arguments_are_kept():
    cmd = [*CMD, "train.resume_note=x", "checkpoint.dir=/a/train.resume=b"]
    assert resume_command(cmd) == [*cmd, "train.resume=auto"]


# --- refusing restarts that could not resume ------------------------------------------------------


@pytest.mark.parametrize("overrides, phrase", [
    (["layout=disaggregated", "checkpoint.every=0"], "checkpoint.every is 0 (checkpoints off)"),
    (["layout=disaggregated", "train.steps=4", "checkpoint.every=4"], "checkpoint.every=4 is not below train.steps=4"),
    ([], "layout 'reference' writes no checkpoints"),
])
def test_restarts_without_a_checkpoint_to_resume_are_refused_naming_the_field(overrides, phrase):
    recipe = load_recipe(TINY, overrides)
    with pytest.raises(ConfigError) as exc:
        check_restartable(recipe, 2, 0)
    assert str(exc.value).startswith("--max-restarts 2: ") and phrase in str(exc.value)
    assert "start over from step 0" in str(exc.value) and "\n" not in str(exc.value)
    assert check_restartable(recipe, 0, 0) == ""  # no restarts asked for: nothing to check


def test_restartable_recipe_gets_a_report_line_and_bad_values_are_refused():
    recipe = load_recipe(TINY, ["layout=disaggregated", "train.steps=6", "checkpoint.every=2"])
    line = check_restartable(recipe, 2, 5)
    assert line.startswith("restarts: up to 2 after a failure, 5 s apart") and "train.resume=auto" in line
    with pytest.raises(ConfigError, match="--max-restarts must be >= 0, got -1"):
        check_restartable(recipe, -1, 0)
    with pytest.raises(ConfigError, match="--restart-delay must be >= 0"):
        check_restartable(recipe, 1, -2)


# --- the loop, on fake launch commands ------------------------------------------------------------

FAKE = textwrap.dedent("""\
    import json, os, signal, subprocess, sys, time
    from pathlib import Path

    state = Path(sys.argv[1])
    runs = json.loads(state.read_text()) if state.exists() else []
    runs.append(sys.argv[2:])
    state.write_text(json.dumps(runs))
    plan = os.environ["FAKE_PLAN"].split(",")  # what each run does: an exit code, 'kill', 'wait' or 'ignore'
    step = plan[min(len(runs), len(plan)) - 1]
    if step == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if step in ("wait", "ignore"):
        if step == "ignore":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            def on_term(*_):
                (state.parent / "got-sigterm").write_text("1")
                sys.exit(1)  # a code that would be restarted, were it not for the interrupt
            signal.signal(signal.SIGTERM, on_term)
        # The helper says when it is running: a Python still starting up (reading .pth files) can
        # swallow a SIGINT and would then hold the test's pipes for its whole sleep.
        ready = state.parent / "helper-ready"
        helper = subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time; "
                                   "pathlib.Path(sys.argv[1]).write_text('1'); time.sleep(300)", str(ready)])
        while not ready.exists():
            time.sleep(0.01)
        (state.parent / "helper.pid").write_text(str(helper.pid))
        (state.parent / "started").write_text("1")
        time.sleep(300)
    sys.exit(int(step))
""")


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_launcher.py"
    script.write_text(FAKE)
    state = tmp_path / "runs.json"

    def cmd(*overrides: str) -> list[str]:
        return [sys.executable, str(script), str(state), "--recipe", "r.yaml", *overrides]

    cmd.runs = lambda: json.loads(state.read_text())
    cmd.dir = tmp_path
    return cmd


def run_loop(fake, plan: str, max_restarts: int, *overrides: str, monkeypatch) -> tuple[int, list[str]]:
    monkeypatch.setenv("FAKE_PLAN", plan)
    said: list[str] = []
    code = supervise.supervise(fake(*overrides), max_restarts, say=said.append)
    return code, said


def test_a_failed_launch_is_relaunched_with_resume_auto_and_finishes(fake, monkeypatch):
    code, said = run_loop(fake, "1,0", 2, "train.resume=none", monkeypatch=monkeypatch)
    assert code == 0
    assert said == ["restart 1/2 after exit code 1 (resuming from the newest checkpoint)", "finished after 1 restart"]
    first, second = fake.runs()
    assert first == ["--recipe", "r.yaml", "train.resume=none"]  # the first launch is the user's command
    assert second == ["--recipe", "r.yaml", "train.resume=auto"]


def test_restarts_stop_at_the_limit_with_the_last_exit_code(fake, monkeypatch):
    code, said = run_loop(fake, "kill,3,1", 2, monkeypatch=monkeypatch)
    assert code == 1
    assert said == [
        "restart 1/2 after exit code 137 (resuming from the newest checkpoint)",
        "restart 2/2 after exit code 3 (resuming from the newest checkpoint)",
        "not restarting: 2 restarts used (--max-restarts 2); exit code 1",
    ]
    runs = fake.runs()
    assert len(runs) == 3 and runs[2].count("train.resume=auto") == 1


@pytest.mark.parametrize("plan, phrase", [("2", "bad input"), ("143", "preempted"), ("0", None)])
def test_bad_input_preemption_and_success_end_the_loop_at_once(fake, monkeypatch, plan, phrase):
    code, said = run_loop(fake, plan, 3, monkeypatch=monkeypatch)
    assert code == int(plan) and len(fake.runs()) == 1
    if phrase is None:
        assert said == []  # nothing to say about a job that just finished
    else:
        assert len(said) == 1 and said[0].startswith("not restarting: ") and phrase in said[0]
        assert said[0].endswith(f"exit code {plan}")


def test_a_relaunch_hook_gives_each_restart_its_command_and_its_error_ends_the_restarts(fake, monkeypatch):
    monkeypatch.setenv("FAKE_PLAN", "1,0")
    seen: list[list[str]] = []

    def relaunch(cmd: list[str]) -> list[str]:  # what --elastic does: new degrees after the resumed command
        seen.append(cmd)
        return [*cmd, "parallel.llm.dp=1"]

    said: list[str] = []
    assert supervise.supervise(fake(), 2, say=said.append, relaunch=relaunch) == 0
    assert seen == [fake("train.resume=auto")]
    assert fake.runs()[1] == ["--recipe", "r.yaml", "train.resume=auto", "parallel.llm.dp=1"]

    def no_layout(cmd: list[str]) -> list[str]:
        raise ConfigError("elastic: host b not answering; cannot re-plan r.yaml for the 2 slots left: too few")

    monkeypatch.setenv("FAKE_PLAN", "1,0")
    (fake.dir / "runs.json").unlink()
    said.clear()
    assert supervise.supervise(fake(), 2, say=said.append, relaunch=no_layout) == 1
    assert len(fake.runs()) == 1
    assert said[-1] == ("not restarting: elastic: host b not answering; cannot re-plan r.yaml for the 2 slots "
                        "left: too few; exit code 1")


def test_a_command_that_cannot_start_is_one_line(tmp_path):
    said: list[str] = []
    assert supervise.supervise([str(tmp_path / "missing")], 2, say=said.append) == 2
    assert len(said) == 1 and said[0].startswith(f"error: cannot start {tmp_path / 'missing'}")


def test_without_restarts_the_launcher_replaces_the_process(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((path, argv)))
    assert supervise.start(["/bin/true", "x"], 0, 0.0) == 0
    assert calls == [("/bin/true", ["/bin/true", "x"])]


# --- signals to the supervisor --------------------------------------------------------------------

SUPERVISOR = ("import sys; from disttrain_ds.launcher.supervise import supervise; "
              "sys.exit(supervise(sys.argv[3:], int(sys.argv[1]), float(sys.argv[2])))")


def start_supervisor(fake, plan: str, max_restarts: int = 3, delay: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "FAKE_PLAN": plan, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(max_restarts), str(delay), *fake()], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 1), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_to_the_supervisor_reaches_the_whole_job_and_stops_restarts(fake, signum, code):
    proc = start_supervisor(fake, "wait")
    wait_for(fake.dir / "started", proc)
    helper = int((fake.dir / "helper.pid").read_text())
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    lines = err.splitlines()
    assert proc.returncode == code, err  # the fake job's: 1 from its SIGTERM handler, else killed by the signal
    assert len(fake.runs()) == 1  # not restarted
    name = signal.Signals(signum).name
    assert lines[-1].startswith(f"not restarting: disttrain-launch got {name} (sent on to the job)")
    assert (fake.dir / "got-sigterm").exists() == (signum == signal.SIGTERM)
    assert gone(helper)  # the launcher's own children got the signal too (its process group)


def test_a_second_signal_kills_a_job_that_ignores_the_first(fake):
    proc = start_supervisor(fake, "ignore")
    wait_for(fake.dir / "started", proc)
    helper = int((fake.dir / "helper.pid").read_text())
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None  # still waiting for the job to stop
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 137, err
    assert "not restarting: disttrain-launch got SIGTERM" in err.splitlines()[-1]
    assert len(fake.runs()) == 1
    time.sleep(0.2)
    assert gone(helper)


def test_a_signal_during_the_restart_delay_stops_before_the_next_launch(fake):
    proc = start_supervisor(fake, "1", delay=60)
    assert proc.stderr.readline() == "restart 1/3 after exit code 1 (resuming from the newest checkpoint)\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 1
    assert err.splitlines()[-1] == "not restarting: disttrain-launch got SIGINT before restart 1; exit code 1"
    assert len(fake.runs()) == 1

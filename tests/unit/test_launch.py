"""``tools/launch.py``: hostfile parsing, slot and reachability checks, the launcher command, one-line errors."""

from __future__ import annotations

import functools
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain_ds.cli import launch
from disttrain_ds.cli.launch import Host, LaunchError, check_reachability, parse_hostfile, select_slots

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
LAUNCH = str(REPO / "tools" / "launch.py")


def hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


@pytest.fixture
def run(run_main):
    return functools.partial(run_main, launch.main)


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(("error: ", "launch.py: error: ")), err
    assert "Traceback" not in err
    return err


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.2 (loopback, but not a name this machine calls itself): its port."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.2", 0))
    except OSError:
        sock.close()
        pytest.skip("cannot bind 127.0.0.2")
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


# --- parsing -------------------------------------------------------------------------------------


def test_parse_accepts_comments_blank_lines_tabs_and_trailing_tokens_with_line_numbers(tmp_path):
    path = hostfile(
        tmp_path,
        "# cluster A\n\n  node-001 slots=8\nnode-002\tslots=4 max_slots=8\n   # spare\nnode-003 slots=2#gpu\n",
    )
    assert parse_hostfile(path) == [Host("node-001", 8, 3), Host("node-002", 4, 4), Host("node-003", 2, 6)]


@pytest.mark.parametrize(
    "line, phrase",
    [
        ("node-002", "expected 'HOST slots=N', got 'node-002'"),
        ("node-002 gpus=8", "expected 'HOST slots=N'"),
        ("node-002 slots = 8", "expected 'HOST slots=N'"),
        ("node-002 slots=0", "slots must be a positive integer, got 'slots=0'"),
        ("node-002 slots=-2", "slots must be a positive integer, got 'slots=-2'"),
        ("node-002 slots=four", "slots must be a positive integer, got 'slots=four'"),
        ("node-002 slots=", "slots must be a positive integer"),
    ],
)
def test_parse_bad_line_names_file_and_line(tmp_path, line, phrase):
    path = hostfile(tmp_path, f"# nodes\nnode-001 slots=8\n{line}\n")
    with pytest.raises(LaunchError) as exc:
        parse_hostfile(path)
    assert str(exc.value).startswith(f"{path}:3: ")
    assert phrase in str(exc.value)


def test_parse_duplicate_host_names_both_lines(tmp_path):
    path = hostfile(tmp_path, "node-001 slots=8\nnode-002 slots=8\nnode-001 slots=4\n")
    with pytest.raises(LaunchError, match=r":3: host 'node-001' is listed twice \(first on line 1\)"):
        parse_hostfile(path)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   \n"])
def test_parse_file_without_hosts_is_refused(tmp_path, text):
    path = hostfile(tmp_path, text)
    with pytest.raises(LaunchError, match=rf"^{path}: no hosts"):
        parse_hostfile(path)


def test_parse_missing_or_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(LaunchError, match="nope: hostfile not found"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        parse_hostfile(tmp_path)  # a directory


# --- slot selection, as DeepSpeed's runner does it ----------------------------------------------

HOSTS = [Host("a", 4, 1), Host("b", 4, 2), Host("c", 2, 3)]


def test_select_without_options_uses_every_slot():
    assert select_slots(HOSTS, src="hf") == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}


def test_select_num_nodes_and_num_gpus_take_first_hosts_and_slots():
    assert select_slots(HOSTS, src="hf", num_nodes=2, num_gpus=2) == {"a": [0, 1], "b": [0, 1]}


def test_select_include_keeps_named_hosts_and_slots_in_hostfile_order():
    assert select_slots(HOSTS, src="hf", include="c@a:1,3") == {"a": [1, 3], "c": [0, 1]}


def test_select_exclude_drops_whole_hosts_and_single_slots():
    assert select_slots(HOSTS, src="hf", exclude="a@b:0") == {"b": [1, 2, 3], "c": [0, 1]}


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"include": "a", "exclude": "b"}, "mutually exclusive"),
        ({"include": "a", "num_gpus": 1}, "cannot be combined"),
        ({"include": "zz"}, "host 'zz' is not in hf"),
        ({"include": "c:2"}, "host 'c' has slots 0-1 (hf:3), no slot 2"),
        ({"exclude": "a:x"}, "slot 'x' of host 'a' is not an integer"),
        ({"include": "a:1:2"}, "bad node spec"),
        ({"exclude": "a@b@c"}, "leaves no slots"),
        ({"num_nodes": 4}, "--num_nodes 4 but hf lists 3 hosts"),
        ({"num_gpus": 3}, "--num_gpus 3 is more than the 2 slots of host 'c' (hf:3)"),
        ({"num_gpus": 0}, "--num_gpus must be >= 1"),
    ],
)
def test_select_refuses_what_deepspeed_would_reject_or_misread(kwargs, phrase):
    with pytest.raises(LaunchError) as exc:
        select_slots(HOSTS, src="hf", **kwargs)
    assert phrase in str(exc.value)


# --- slot count against the recipe ---------------------------------------------------------------


def test_slot_mismatch_names_hostfile_slots_ranks_breakdown_and_fix(tmp_path, run):
    path = hostfile(tmp_path, "# one box\nlocalhost slots=3\n")
    code, out, err = run("--hostfile", path, "--recipe", TINY, "layout=disaggregated")
    err = one_line_error(code, err)
    assert out == ""
    assert f"{path}: 3 slots used (localhost 3)" in err
    assert "layout 'disaggregated'" in err and "needs 4 ranks (encoder 1 + llm 2 + generator 1)" in err
    assert f"set 'localhost slots=4' on {path}:2" in err


def test_slot_mismatch_after_num_gpus_suggests_changing_the_selection(tmp_path, run):
    path = hostfile(tmp_path, "localhost slots=8\n")
    code, _, err = run("--hostfile", path, "--num_gpus", "2", "--recipe", TINY, "layout=disaggregated")
    err = one_line_error(code, err)
    assert "2 slots used" in err and "--num_nodes/--num_gpus/--include/--exclude" in err


def test_reference_layout_needs_exactly_one_slot(tmp_path, run):
    path = hostfile(tmp_path, "localhost slots=2\n")
    code, _, err = run("--hostfile", path, "--recipe", TINY)
    assert "needs 1 rank (reference: one process)" in one_line_error(code, err)


# --- reachability --------------------------------------------------------------------------------


def test_unreachable_and_unresolvable_hosts_are_each_named_with_their_line():
    hosts = [Host("192.0.2.1", 8, 2), Host("no-such-host.invalid", 8, 5)]
    start = time.monotonic()
    problems = check_reachability(hosts, src="hf", port=22, timeout=0.5, local=frozenset())
    assert time.monotonic() - start < 5
    assert problems[0].startswith("hf:2: host '192.0.2.1' is unreachable: ")
    assert problems[1] == "hf:5: host 'no-such-host.invalid' does not resolve (check the name, DNS or /etc/hosts)"


def test_listening_host_passes_and_local_names_are_not_probed(listener):
    hosts = [Host("127.0.0.2", 4, 1), Host("this-box", 4, 2)]
    assert check_reachability(hosts, src="hf", port=listener, timeout=2, local=frozenset({"this-box"})) == []
    assert len(check_reachability(hosts, src="hf", port=listener, timeout=2, local=frozenset())) == 1


def test_local_names_include_localhost_and_this_machines_hostname():
    names = launch.local_names()
    assert {"localhost", "127.0.0.1", socket.gethostname()} <= names
    assert "127.0.0.2" not in names


def test_cli_unreachable_host_is_one_line_naming_host_and_line(tmp_path, run):
    path = hostfile(tmp_path, "# cluster\n192.0.2.1 slots=2\nno-such-host.invalid slots=2\n")
    argv = ["--hostfile", path, "--connect-timeout", "0.5", "--recipe", TINY, "layout=disaggregated"]
    code, _, err = run(*argv)
    err = one_line_error(code, err)
    assert err.startswith(f"error: {path}:2: host '192.0.2.1' is unreachable")
    assert f"{path}:3: host 'no-such-host.invalid' does not resolve" in err
    code, out, _ = run(*argv, "--skip-reachability", "--dry-run")
    assert code == 0 and "skipped for 2 remote hosts" in out


# --- the launcher command ------------------------------------------------------------------------


def command_of(out: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith("command: ")]
    assert len(lines) == 1, out
    return shlex.split(lines[0].removeprefix("command: "))


def test_dry_run_prints_checks_and_local_deepspeed_command_without_launching(tmp_path, run):
    """``tools/launch.py`` (a checkout) starts ``tools/train.py`` on every rank."""
    path = hostfile(tmp_path, "localhost slots=4\n")
    argv = ["--hostfile", path, "--dry-run", "--master_port", "29611", "--recipe", TINY, "layout=disaggregated"]
    code, out, err = run_main_checkout(run, *argv, "train.steps=2")
    assert code == 0 and err == ""
    assert "needs 4 ranks (encoder 1 + llm 2 + generator 1): matches" in out
    assert "dry run: not launching" in out
    cmd = command_of(out)
    assert Path(cmd[0]).name == "deepspeed" or cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    script = next(i for i, arg in enumerate(cmd) if arg.endswith("train.py"))
    launcher_opts = cmd[:script]
    for opt in (["--hostfile", path], ["--master_port", "29611"], ["--master_addr", "127.0.0.1"]):
        i = launcher_opts.index(opt[0])
        assert launcher_opts[i : i + 2] == opt
    assert "--no_ssh_check" in launcher_opts  # a local hostfile must not make DeepSpeed ssh to itself
    assert "--module" not in launcher_opts
    assert (Path.cwd() / cmd[script]).resolve() == REPO / "tools" / "train.py"
    assert cmd[script + 1 :] == ["--recipe", TINY, "layout=disaggregated", "train.steps=2"]


def run_main_checkout(run, *argv: str) -> tuple[int, str, str]:
    """``launch.main`` as ``tools/launch.py`` calls it."""
    main = functools.partial(launch.main, train_script=REPO / "tools" / "train.py")
    return run.func(main, *argv)  # ``run`` is run_main bound to launch.main


def test_installed_launcher_runs_the_train_module_on_every_rank(tmp_path, run):
    """``disttrain-launch`` needs no checkout: ranks run ``python -m disttrain_ds.cli.train``."""
    path = hostfile(tmp_path, "localhost slots=4\n")
    code, out, err = run("--hostfile", path, "--dry-run", "--recipe", "tiny_cpu", "layout=disaggregated")
    assert code == 0, err
    cmd = command_of(out)
    i = cmd.index("--module")
    assert cmd[i + 1 :] == [launch.TRAIN_MODULE, "--recipe", "tiny_cpu", "layout=disaggregated"]
    assert not any(arg.endswith("train.py") for arg in cmd)


def test_dry_run_with_reachable_remote_host_probes_it_and_keeps_ssh(tmp_path, run, listener):
    path = hostfile(tmp_path, "localhost slots=2\n127.0.0.2 slots=2\n")
    argv = ["--hostfile", path, "--ssh-port", str(listener), "--dry-run", "--recipe", TINY, "layout=disaggregated"]
    code, out, err = run(*argv)
    assert code == 0, err
    assert f"reachability: 1 remote host answered on port {listener}" in out
    cmd = command_of(out)
    assert "--no_ssh_check" not in cmd and "--master_addr" not in cmd
    assert cmd[cmd.index("--ssh_port") + 1] == str(listener)


# --- restarts (disttrain_ds/launcher/supervise.py; the loop itself: tests/unit/test_supervise.py) ----------


def test_max_restarts_without_checkpoints_is_one_line_naming_the_field(tmp_path, run):
    path = hostfile(tmp_path, "localhost slots=4\n")
    code, out, err = run("--hostfile", path, "--max-restarts", "2", "--dry-run", "--recipe", TINY,
                         "layout=disaggregated")
    err = one_line_error(code, err)
    assert out == "" and "--max-restarts 2: checkpoint.every is 0 (checkpoints off)" in err


@pytest.mark.parametrize("flag, phrase", [("--max-restarts", "--max-restarts must be >= 0, got -1"),
                                          ("--restart-delay", "--restart-delay must be >= 0, got -1")])
def test_negative_restart_options_are_one_line(tmp_path, run, flag, phrase):
    path = hostfile(tmp_path, "localhost slots=4\n")
    code, _, err = run("--hostfile", path, flag, "-1", "--dry-run", "--recipe", TINY, "layout=disaggregated",
                       "checkpoint.every=2")
    assert phrase in one_line_error(code, err)


def test_max_restarts_is_reported_and_supervises_the_unchanged_first_command(tmp_path, run, monkeypatch):
    path = hostfile(tmp_path, "localhost slots=4\n")
    argv = ["--hostfile", path, "--max-restarts", "2", "--restart-delay", "10", "--recipe", TINY,
            "layout=disaggregated", "train.steps=6", "checkpoint.every=2"]
    code, out, err = run(*argv, "--dry-run")
    assert code == 0, err
    assert "restarts: up to 2 after a failure, 10 s apart (not after exit 2 or 143)" in out
    assert command_of(out)[-3:] == ["layout=disaggregated", "train.steps=6", "checkpoint.every=2"]
    started = []
    monkeypatch.setattr(launch, "start", lambda cmd, n, delay, relaunch: started.append((cmd, n, delay, relaunch)) or 0)
    code, out, _ = run(*argv)
    assert code == 0 and started == [(command_of(out), 2, 10.0, None)]
    code, out, _ = run("--hostfile", path, "--recipe", TINY, "layout=disaggregated")  # no restarts: exec as before
    assert code == 0 and started[-1] == (command_of(out), 0, 0.0, None) and "restarts:" not in out


# --- the script itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, extra, phrase",
    [
        ("localhost slots=3\n", ["layout=disaggregated"], "needs 4 ranks"),
        ("localhost slots=4\nbad line here\n", ["layout=disaggregated"], ":2: expected 'HOST slots=N'"),
        ("localhost slots=4\n", ["parallel.llm.pp=zero"], "'parallel.llm.pp' must be an integer"),
    ],
)
def test_script_errors_exit_2_with_one_stderr_line(tmp_path, text, extra, phrase):
    path = hostfile(tmp_path, text)
    proc = subprocess.run(
        [sys.executable, LAUNCH, "--hostfile", path, "--recipe", TINY, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert phrase in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_launch_trains_tiny_disaggregated_recipe_through_deepspeed(tmp_path):
    path = hostfile(tmp_path, "localhost slots=4\n")
    run_dir = tmp_path / "run"
    overrides = ["layout=disaggregated", "train.steps=2", f"logging.dir={run_dir}", "logging.wandb=disabled"]
    proc = subprocess.run(
        [sys.executable, LAUNCH, "--hostfile", path, "--recipe", TINY, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reachability: every host is this machine" in proc.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


# --- tensor-parallel groups and hosts ------------------------------------------------------------


@pytest.mark.parametrize("axis, words", [("tp", "tensor-parallel group span hosts"),
                                         ("sp", "sequence-parallel group span hosts")])
@pytest.mark.parametrize("hosts, spans", [("localhost slots=2\n127.0.0.2 slots=2\n", True),
                                          ("localhost slots=1\n127.0.0.2 slots=3\n", False)])
def test_dry_run_warns_when_a_tp_or_sp_group_spans_hosts(tmp_path, run, hosts, spans, axis, words):
    # encoder rank 0, LLM TP=2 (or SP=2) on ranks 1-2, generator rank 3: 2 + 2 slots split the pair.
    path = hostfile(tmp_path, hosts)
    code, out, err = run("--hostfile", path, "--dry-run", "--skip-reachability", "--recipe", TINY,
                         "layout=disaggregated", f"parallel.llm.{axis}=2", "parallel.llm.pp=1")
    assert code == 0, err
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    if spans:
        assert len(warning) == 1 and f"1 {words}" in warning[0]
        assert "llm ranks 1-2 (localhost, 127.0.0.2)" in warning[0]
    else:
        assert warning == []



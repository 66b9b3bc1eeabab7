"""``disttrain-launch`` and the socket interfaces: GLOO_SOCKET_IFNAME set from NCCL_SOCKET_IFNAME for
multi-host jobs, both checked against this machine's interfaces, and both passed to remote ranks
through a DeepSpeed environment file of its own (the user's files left as they are)."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import pytest

from disttrain_ds.cli import launch
from disttrain_ds.launcher import netenv
from disttrain_ds.launcher.hostfile import LaunchError
from disttrain_ds.launcher.netenv import (
    GLOO,
    NCCL,
    apply_socket_env,
    gloo_from_nccl,
    interface_problem,
    nccl_matches,
    plan_socket_env,
    read_env_files,
)

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml")
NAMES = ["lo", "docker0", "eth0", "ib0"]


def plan(env: dict, tmp_path: Path, *, remote: bool = True, ranks_here: bool = True, interfaces=NAMES):
    return plan_socket_env(env, remote=remote, ranks_here=ranks_here, interfaces=interfaces, host="node-001",
                           home=str(tmp_path / "home"), cwd=str(tmp_path / "work"))


@pytest.fixture
def dirs(tmp_path: Path) -> Path:
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    return tmp_path


def test_nccl_patterns_are_prefixes_exact_names_or_exclusions():
    assert nccl_matches("eth", NAMES) == ["eth0"]
    assert nccl_matches("eth,ib", NAMES) == ["eth0", "ib0"]
    assert nccl_matches("=eth", NAMES) == [] and nccl_matches("=eth0", NAMES) == ["eth0"]
    assert nccl_matches("^docker,lo", NAMES) == ["eth0", "ib0"]
    assert nccl_matches("^=docker0", NAMES) == ["eth0", "ib0"]  # loopback is no way between hosts
    assert nccl_matches("^eth,ib,docker", NAMES) == []


def test_gloo_gets_the_names_nccl_is_given_but_not_an_exclusion():
    assert gloo_from_nccl("eth0") == "eth0"
    assert gloo_from_nccl("=eth0, ib0") == "eth0,ib0"
    assert gloo_from_nccl("^docker") is None


def test_interface_problems_name_the_variable_and_what_this_machine_has():
    assert interface_problem(GLOO, "eth0,ib0", NAMES, "node-001") is None
    assert interface_problem(NCCL, "^docker", NAMES, "node-001") is None
    msg = interface_problem(GLOO, "eth0,eth9", NAMES, "node-001")
    assert msg.startswith("GLOO_SOCKET_IFNAME=eth0,eth9: no interface named eth9 on this machine (node-001: lo,")
    assert "exact interface names" in msg
    msg = interface_problem(NCCL, "ens", NAMES, "node-001")
    assert msg.startswith("NCCL_SOCKET_IFNAME=ens: matches no interface") and "prefixes" in msg
    many = [f"veth{i}" for i in range(12)]
    assert "+4 more" in interface_problem(GLOO, "eth0", many, "h")


def test_env_files_are_read_as_deepspeed_reads_them(dirs):
    (dirs / "home" / ".deepspeed_env").write_text("A=1\nB=home\n")
    (dirs / "work" / ".deepspeed_env").write_text("B=work\nC=x=y")
    lines, values, found = read_env_files({}, str(dirs / "home"), str(dirs / "work"))
    assert lines == ["A=1", "B=home", "B=work", "C=x=y"] and values == {"A": "1", "B": "work", "C": "x=y"}
    assert found == [str(dirs / "home" / ".deepspeed_env"), str(dirs / "work" / ".deepspeed_env")]
    mine = dirs / "mine.env"
    mine.write_text("D=4\n")
    assert read_env_files({"DS_ENV_FILE": str(mine)}, str(dirs / "home"), str(dirs / "work"))[1] == {"D": "4"}
    (dirs / "work" / ".deepspeed_env").write_text("B=2\n\nC=3\n")  # DeepSpeed's runner dies on the blank line
    with pytest.raises(LaunchError, match=r"/work/\.deepspeed_env:2: DeepSpeed reads every line as KEY=VALUE, got ''$"):
        read_env_files({}, str(dirs / "home"), str(dirs / "work"))


def test_multi_host_job_gets_gloo_from_nccl_checked_and_forwarded(dirs):
    p = plan({NCCL: "eth0"}, dirs)
    assert p.set_env == {GLOO: "eth0"}
    assert p.lines[0].startswith("network: GLOO_SOCKET_IFNAME=eth0 set from NCCL_SOCKET_IFNAME")
    assert "NCCL_SOCKET_IFNAME=eth0, GLOO_SOCKET_IFNAME=eth0: interfaces present here" in p.lines[1]
    assert p.env_file == "NCCL_SOCKET_IFNAME=eth0\nGLOO_SOCKET_IFNAME=eth0\n"
    assert "through DS_ENV_FILE, a new file" in p.lines[2]


def test_a_single_host_job_is_left_alone_but_still_checked(dirs):
    assert plan({NCCL: "eth0"}, dirs, remote=False).set_env == {}
    assert plan({NCCL: "eth0"}, dirs, remote=False).env_file is None
    assert plan({}, dirs).lines == []  # nothing set: nothing to say
    with pytest.raises(LaunchError, match=r"^GLOO_SOCKET_IFNAME=eth7: no interface named eth7"):
        plan({GLOO: "eth7"}, dirs, remote=False)


@pytest.mark.parametrize("env, phrase", [
    ({NCCL: "^docker,lo"},
     "NCCL_SOCKET_IFNAME=^docker,lo excludes interfaces, which gloo cannot take; set GLOO_SOCKET_IFNAME"),
    ({NCCL: "eth"}, "GLOO_SOCKET_IFNAME=eth: no interface named eth on this machine"),
    ({NCCL: "ens", GLOO: "eth0"}, "NCCL_SOCKET_IFNAME=ens: matches no interface"),
])
def test_unusable_interface_settings_are_one_line(dirs, env, phrase):
    with pytest.raises(LaunchError) as exc:
        plan(env, dirs)
    assert phrase in str(exc.value) and "\n" not in str(exc.value)
    if env == {NCCL: "eth"}:
        assert str(exc.value).endswith("(set from NCCL_SOCKET_IFNAME)")


def test_a_machine_running_no_ranks_does_not_judge_the_nodes_interfaces(dirs):
    p = plan({NCCL: "ens"}, dirs, ranks_here=False)
    assert "not checked here (this machine runs no ranks)" in p.lines[1] and p.set_env == {GLOO: "ens"}


def test_the_users_env_files_are_copied_into_the_new_one_and_left_as_they_are(dirs):
    home, work = dirs / "home" / ".deepspeed_env", dirs / "work" / ".deepspeed_env"
    home.write_text("FOO=1\n")
    work.write_text("BAR=2\n")
    p = plan({NCCL: "eth0"}, dirs)
    assert p.env_file == "FOO=1\nBAR=2\nNCCL_SOCKET_IFNAME=eth0\nGLOO_SOCKET_IFNAME=eth0\n"
    assert "with the lines of" in p.lines[-1] and "(left as they are)" in p.lines[-1]
    assert home.read_text() == "FOO=1\n" and work.read_text() == "BAR=2\n"


def test_keys_the_users_file_already_sets_are_not_written_again(dirs):
    (dirs / "home" / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\nGLOO_SOCKET_IFNAME=eth0\n")
    p = plan({NCCL: "eth0", GLOO: "eth0"}, dirs)
    assert p.env_file is None
    assert p.lines[-1].startswith("network: remote ranks get NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME from ")
    (dirs / "home" / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=ib0\n")
    p = plan({NCCL: "eth0", GLOO: "eth0"}, dirs)
    assert any("get GLOO_SOCKET_IFNAME=ib0 from" in line and "DeepSpeed's file wins" in line for line in p.lines)
    assert p.env_file == "GLOO_SOCKET_IFNAME=ib0\nNCCL_SOCKET_IFNAME=eth0\n"  # only the missing key added


def test_applying_sets_the_variables_and_writes_the_file_only_for_a_real_launch(dirs):
    p = plan({NCCL: "eth0"}, dirs)
    environ: dict[str, str] = {}
    lines = apply_socket_env(p, environ, write=False)
    assert environ == {} and lines[-1] == "network: dry run: nothing set, no file written"
    lines = apply_socket_env(p, environ, write=True)
    path = environ.pop(netenv.DS_ENV_FILE)
    try:
        assert environ == {GLOO: "eth0"} and lines[-1] == f"network: DS_ENV_FILE={path}"
        assert Path(path).read_text() == p.env_file
    finally:
        os.unlink(path)


# --- through disttrain-launch -------------------------------------------------------------------


def _an_interface() -> str:
    names = [n for _, n in socket.if_nameindex() if n != "lo"]
    if not names:
        pytest.skip("this machine has no interface besides loopback")
    return names[0]


@pytest.fixture
def launch_env(monkeypatch, dirs):
    """A clean environment for the launcher: no interface variables, HOME and cwd without env files."""
    environ = {k: v for k, v in os.environ.items() if k not in (NCCL, GLOO, netenv.DS_ENV_FILE)}
    environ["HOME"] = str(dirs / "home")
    monkeypatch.setattr(os, "environ", environ)  # the launch writes to it; the test process stays as it was
    monkeypatch.chdir(dirs / "work")
    (dirs / "hostfile").write_text("localhost slots=2\n127.0.0.2 slots=2\n")  # this machine and a remote one
    return environ


@pytest.fixture
def run(run_main):
    return functools.partial(run_main, launch.main)


def test_dry_run_reports_gloo_from_nccl_and_sets_nothing(run, launch_env, dirs):
    iface = _an_interface()
    launch_env[NCCL] = iface
    code, out, err = run("--hostfile", str(dirs / "hostfile"), "--skip-reachability", "--dry-run", "--recipe", TINY,
                         "layout=disaggregated")
    assert code == 0, err
    assert f"network: GLOO_SOCKET_IFNAME={iface} set from NCCL_SOCKET_IFNAME" in out
    assert "network: dry run: nothing set, no file written" in out
    assert GLOO not in launch_env and netenv.DS_ENV_FILE not in launch_env


def test_a_launch_hands_the_deepspeed_launcher_both_variables(run, launch_env, dirs, monkeypatch):
    iface = _an_interface()
    launch_env[NCCL] = iface
    started = []
    monkeypatch.setattr(launch, "start", lambda cmd, n, delay, relaunch: started.append(dict(os.environ)) or 0)
    code, out, err = run("--hostfile", str(dirs / "hostfile"), "--skip-reachability", "--recipe", TINY,
                         "layout=disaggregated")
    assert code == 0, err
    env = started[0]
    path = env[netenv.DS_ENV_FILE]
    try:
        assert env[GLOO] == iface and f"network: DS_ENV_FILE={path}" in out
        assert Path(path).read_text() == f"{NCCL}={iface}\n{GLOO}={iface}\n"
    finally:
        os.unlink(path)


def test_an_interface_this_machine_lacks_stops_the_launch_in_one_line(run, launch_env, dirs):
    launch_env[GLOO] = "no-such-if0"
    code, out, err = run("--hostfile", str(dirs / "hostfile"), "--skip-reachability", "--dry-run", "--recipe", TINY,
                         "layout=disaggregated")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: GLOO_SOCKET_IFNAME=no-such-if0: no interface named no-such-if0 on this machine")

"""Helpers for multi-process tests: launch a layout with torchrun and compare with the reference."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("run_layout.py")
# Every multi-process job holds its point-to-point messages and its start-up to NCCL's rules
# (comm/nccl_emulation.py): a protocol that only works under gloo's tag matching and buffering, or a
# start-up whose ranks make different process groups, must fail here. Each test runs under the eager
# start-up (every group a world-wide split: the deepspeed launcher's, and this project's on every
# launcher) and, in the slow tier, again under torchrun's lazy one.
NCCL_MODES = [pytest.param("eager", id="eager"), pytest.param("lazy", id="lazy", marks=pytest.mark.slow)]
NCCL_RULES = {"DISTTRAIN_NCCL_EMULATION": "eager"}


@pytest.fixture(autouse=True, params=NCCL_MODES)
def _nccl_rules_for_every_job(request, monkeypatch):
    """Every process a multi-process test starts, whichever helper starts it, inherits the NCCL
    rules of this run's mode; a negative control that wants plain gloo passes
    ``DISTTRAIN_NCCL_EMULATION=0`` itself."""
    monkeypatch.setenv("DISTTRAIN_NCCL_EMULATION", request.param)
    return request.param


def nccl_rules() -> dict[str, str]:
    """The emulation mode of the running test, for environments built from scratch."""
    return {"DISTTRAIN_NCCL_EMULATION": os.environ.get("DISTTRAIN_NCCL_EMULATION", NCCL_RULES["DISTTRAIN_NCCL_EMULATION"])}


def launcher_cmd(launcher: str, nproc: int) -> list[str]:
    """torchrun (an agent per node, lazy NCCL unless the job binds devices) or the deepspeed
    launcher (no agent: rank 0 hosts the store; it binds each process to its device)."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --no_local_rank: the runner script takes no --local_rank flag (LOCAL_RANK is in the environment)
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(port),
            "--no_local_rank"]


def launch(out: Path, nproc: int, overrides: list[str], fault: str | None = None, timeout: int = 600,
           env_extra: dict | None = None, check: bool = True, recipe: str = "tiny_cpu", launcher: str = "torchrun"):
    """Run tests/multiproc/run_layout.py under torchrun (or ``launcher="deepspeed"``); returns
    (losses per step, params, shapes), or with ``check=False`` the finished process, whatever its
    exit code. ``recipe``: a shipped recipe's name or a YAML path."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher_cmd(launcher, nproc), str(RUNNER), str(out)]
    if fault:
        cmd += ["--fault", fault]
    cmd += ["--recipe", str(recipe), "parallel.comm_timeout_s=120", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **nccl_rules(),
           **(env_extra or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    (out / "launch.log").write_text(proc.stdout + proc.stderr)
    if not check:
        return proc
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    params: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("params_rank*.pt")):
        params.update(torch.load(f))
    shapes = [json.loads(f.read_text()) for f in sorted(out.glob("shapes_rank*.json"))]
    return rows, params, shapes


@pytest.fixture(scope="session")
def reference_run():
    """Reference losses and parameters per recipe override list (cached)."""
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.reference import reference_layer_state, train_reference

    cache: dict[tuple, tuple] = {}

    def get(overrides: list[str], recipe_name: str = "tiny_cpu"):
        key = (recipe_name, *overrides)
        if key not in cache:
            recipe = load_recipe(recipe_name, ["layout=reference", *overrides])
            records, model = train_reference(recipe, None, log=None)
            cache[key] = ([r["loss"] for r in records], reference_layer_state(model))
        return cache[key]

    return get


def max_param_mismatch(ours: dict, ref: dict) -> tuple[float, str]:
    """Largest relative-to-scale difference over all parameters, and where it is."""
    assert ours.keys() == ref.keys(), sorted(set(ours) ^ set(ref))[:5]
    worst, where = 0.0, ""
    for k in ref:
        diff = float((ours[k].float() - ref[k].float()).abs().max()) if ref[k].numel() else 0.0
        scale = max(float(ref[k].float().abs().max()) if ref[k].numel() else 0.0, 1e-3)
        if diff / scale > worst:
            worst, where = diff / scale, k
    return worst, where


def start_ranks(run_dir: Path, world: int, overrides: list[str]) -> list[subprocess.Popen]:
    """Start ``tools/train.py`` once per rank, without an agent (rank 0 hosts the store), as a
    multi-node launcher would; the caller waits for or kills them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {
            **os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **nccl_rules(),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }
        cmd = [sys.executable, "tools/train.py", "--recipe", "recipes/tiny_cpu.yaml", "layout=disaggregated",
               f"logging.dir={run_dir}", "logging.wandb=disabled", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_until(cond, procs: list[subprocess.Popen], what: str, timeout: float = 300) -> None:
    """Poll ``cond()`` until true; fail if a rank exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a rank exited (code {p.returncode}) before {what}: " + p.communicate()[1][-3000:])
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def metrics_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

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
# Every multi-process job holds its point-to-point messages to NCCL's rules (comm/nccl_emulation.py):
# a protocol that only works under gloo's tag matching and buffering must fail here.
NCCL_RULES = {"DISTTRAIN_NCCL_EMULATION": "1"}


@pytest.fixture(autouse=True)
def _nccl_rules_for_every_job(monkeypatch):
    """Every process a multi-process test starts, whichever helper starts it, inherits the NCCL
    rules; a negative control that wants plain gloo passes ``DISTTRAIN_NCCL_EMULATION=0`` itself."""
    for key, value in NCCL_RULES.items():
        monkeypatch.setenv(key, value)


def launch(out: Path, nproc: int, overrides: list[str], fault: str | None = None, timeout: int = 600,
           env_extra: dict | None = None, check: bool = True, recipe: str = "tiny_cpu"):
    """Run tests/multiproc/run_layout.py under torchrun; returns (losses per step, params, shapes),
    or with ``check=False`` the finished process, whatever its exit code. ``recipe``: a shipped
    recipe's name or a YAML path."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(RUNNER), str(out)]
    if fault:
        cmd += ["--fault", fault]
    cmd += ["--recipe", str(recipe), "parallel.comm_timeout_s=120", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **NCCL_RULES,
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
    from disttrain_ds.config import load_recipe
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
            **os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", **NCCL_RULES,
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

"""CUDA paths of the runtime (side-stream communicator, NCCL). Skipped without enough GPUs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(name: str, gpus: int) -> list[str]:
    """torchrun, or the deepspeed launcher (which binds every process to its GPU: eager NCCL)."""
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus),
            "--master_port", str(_free_port())]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
@pytest.mark.parametrize("gpus, layout", [
    (4, []),
    (3, ["parallel.llm.pp=1"]),
    # Mixed TP degrees (encoder 1, LLM 2, generator 1), as in every mllm_* recipe: under the
    # deepspeed launcher each group is a world-wide NCCL split, which member-only groups deadlock.
    (4, ["parallel.llm.pp=1", "parallel.llm.tp=2"]),
])
def test_disaggregated_tiny_on_gpus_matches_cpu_reference(launcher, gpus, layout, tmp_path):
    _need_gpus(gpus)
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.runtime.reference import train_reference

    steps = ["train.steps=3", "optim.name=sgd", "optim.lr=0.05"]
    cmd = [*_launcher(launcher, gpus), str(REPO / "tools" / "train.py"), "--recipe",
           str(REPO / "recipes" / "tiny_cpu.yaml"), "layout=disaggregated", f"logging.dir={tmp_path / 'run'}",
           "logging.wandb=disabled", "parallel.comm_timeout_s=120", *steps, *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ref, _ = train_reference(load_recipe(REPO / "recipes" / "tiny_cpu.yaml", steps), None, log=None)
    # TF32/cuDNN kernels differ from CPU ones: compare to a looser tolerance than the CPU tests.
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-3)

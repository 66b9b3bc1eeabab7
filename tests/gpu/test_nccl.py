"""The inter-engine communicator on real NCCL (one GPU per rank). Skipped without 2 GPUs.

The same script runs on CPU under the NCCL-rules emulation in the default suite
(tests/multiproc/test_comm.py); here it runs on the real backend, side stream included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_boundary_messages_cross_nccl_in_order_both_ways(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    world = min(torch.cuda.device_count(), 4)  # encoder rank 0 -> LLM dp = world - 1 (splits 6 samples)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(REPO / "tests" / "multiproc" / "run_boundary.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {r: json.loads((tmp_path / f"boundary_rank{r}.json").read_text()) for r in range(world)}
    assert got[0]["0"][:4] == [0.0, 0.0, 0.0, 2.0]  # gradients (x2) back in the encoder's sample order

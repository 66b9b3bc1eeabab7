"""Measuring one GPU for ``bench/gpu_modules.py``: step timers, an fp32-master AdamW, a GEMM
ceiling, the card's clocks and power limit, and one profiled step's time by category."""

from __future__ import annotations

import re
import statistics
import subprocess
import time
from typing import Callable

import torch


class Optimizer:
    """AdamW over the model's bf16 weights, or with ``master`` over fp32 copies of them (the
    gradients copied up before and the weights copied down after each step, as DeepSpeed's bf16
    optimizer does)."""

    def __init__(self, params, device: torch.device, master: bool):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params] if master else None
        kind = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
        self.opt = torch.optim.AdamW(self.master if master else self.params, lr=1e-5, **kind)

    def step(self) -> None:
        if self.master is not None:
            for m, p in zip(self.master, self.params):
                m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
            for p in self.params:
                p.grad = None


def timer(device: torch.device):
    """Returns ``measure(fn) -> milliseconds``: CUDA events on GPU, wall clock on CPU."""
    if device.type == "cuda":
        def measure(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def measure(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return measure


CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|flex|_efficient_attention|cudnn.*(mha|attn)", re.I)),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|conv|aten::(mm|bmm|addmm|linear)$", re.I)),
)
"""Kernel (CUDA) or operator (CPU) name patterns of each category, tried in order; the rest is "other"."""


def category(name: str) -> str:
    """The breakdown category of a kernel or operator name."""
    return next((cat for cat, pat in CATEGORIES if pat.search(name)), "other")


def breakdown(step: Callable[[], None], device: torch.device) -> dict[str, float]:
    """Milliseconds of one profiled ``step`` by category (``CATEGORIES``, "other", and "idle": the
    step's wall time not covered by device kernels on CUDA, or by operators on the CPU)."""
    from torch.profiler import ProfilerActivity, profile  # deferred: only a measured run loads the profiler

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) * 1e3
    out = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for e in prof.events():
        if cuda:
            if e.device_type.name != "CUDA":
                continue
            ms = e.device_time_total / 1e3
        else:
            ms = e.self_cpu_time_total / 1e3
        out[category(e.name)] += ms
    out["idle"] = max(wall - sum(out.values()), 0.0)
    return out


def gemm_ceiling(device: torch.device, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    """TFLOP/s of an n x n x n GEMM in ``dtype`` on ``device`` (median of ``reps``): what a
    module's large GEMMs could reach on this card in this run (clocks and power as they are)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    measure = timer(device)
    for _ in range(3):
        measure(lambda: a @ b)
    ms = statistics.median(measure(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / (ms / 1e3) / 1e12


def card_info() -> dict[str, str]:
    """The card's name, SM clock now and at most, and power limit (nvidia-smi; {} without it)."""
    fields = "name,clocks.sm,clocks.max.sm,power.limit,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    return dict(zip(fields.split(","), (v.strip() for v in out.split(","))))

"""Peak dense throughput of accelerators, the denominator of MFU.

Table values are vendor datasheet figures for dense (no structured sparsity) bf16 tensor
math, except V100 and T4 which have no bf16 and list fp16. On a machine with no
accelerator, :func:`measure_cpu_peak_tflops` times a matmul instead: that is an estimate
of what this CPU reaches, not a datasheet peak.
"""

from __future__ import annotations

import re
import time

import torch

# (name patterns, dense TFLOP/s, label). First match wins, so specific variants come
# before the generic name (e.g. "h100 pcie" before "h100").
PEAK_TABLE: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("h100 pcie", "h800 pcie"), 756.0, "H100/H800 PCIe, bf16"),
    (("h100 nvl", "h200 nvl"), 835.0, "H100/H200 NVL, bf16"),
    (("h100", "h800", "gh200"), 989.0, "H100/H800 SXM, bf16"),
    (("h200",), 989.0, "H200 SXM, bf16"),
    (("h20",), 148.0, "H20, bf16"),
    (("b200",), 2250.0, "B200, bf16"),
    (("a100", "a800"), 312.0, "A100/A800, bf16"),
    (("a30",), 165.0, "A30, bf16"),
    (("a10",), 125.0, "A10, bf16"),
    (("l40s",), 362.0, "L40S, bf16"),
    (("l40",), 181.0, "L40, bf16"),
    (("l4",), 121.0, "L4, bf16"),
    (("v100",), 125.0, "V100, fp16 (no bf16)"),
    (("t4",), 65.0, "T4, fp16 (no bf16)"),
    (("mi300x", "mi325x"), 1307.4, "MI300X/MI325X, bf16"),
    (("mi250x",), 383.0, "MI250X, bf16"),
    (("mi250",), 362.1, "MI250, bf16"),
)


def _normalise(name: str) -> str:
    return " ".join(re.split(r"[\s\-_/,()]+", name.lower())).strip()


def _contains(name: str, pattern: str) -> bool:
    # Whole-token match, so "a10" matches "NVIDIA A10" but not "A100" or "A10G".
    return re.search(rf"(?<![a-z0-9]){re.escape(pattern)}(?![a-z0-9])", name) is not None


def lookup_peak(device_name: str) -> tuple[float, str] | None:
    """(dense TFLOP/s, table label) for a ``torch.cuda.get_device_name()``-style string,
    matched case-insensitively on whole tokens; None if the device is not in the table."""
    name = _normalise(device_name)
    for patterns, tflops, label in PEAK_TABLE:
        if any(_contains(name, p) for p in patterns):
            return tflops, label
    return None


def lookup_peak_tflops(device_name: str) -> float | None:
    """Dense peak TFLOP/s of ``device_name`` from the table, or None if unknown."""
    hit = lookup_peak(device_name)
    return None if hit is None else hit[0]


_CPU_PEAK_CACHE: dict[tuple[torch.dtype, int, int], float] = {}


def _time_matmul(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Best wall time of ``repeats`` matmuls, after one warm-up."""
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu_peak_tflops(
    dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 3,
) -> float:
    """CPU ESTIMATE, not a datasheet peak: TFLOP/s of the fastest of ``repeats`` square
    ``size`` x ``size`` matmuls on this CPU with torch's current thread count.
    Measured once per (dtype, size, repeats) and cached for the process."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    key = (dtype, size, repeats)
    if key not in _CPU_PEAK_CACHE:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        seconds = max(_time_matmul(a, b, repeats), 1e-9)
        _CPU_PEAK_CACHE[key] = 2.0 * size**3 / seconds / 1e12
    return _CPU_PEAK_CACHE[key]


def resolve_peak(override: float | None, device_name: str | None) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from).

    Order: a recipe override; the table entry for ``device_name``; a measured CPU matmul
    estimate when there is no accelerator (``device_name`` None or "cpu"). An accelerator
    missing from the table is an error: set the peak in the recipe.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"override must be a positive TFLOP/s value, got {override}")
        return float(override), "recipe override"
    if device_name is None or device_name.strip().lower() == "cpu":
        return measure_cpu_peak_tflops(), "measured CPU matmul estimate"
    hit = lookup_peak(device_name)
    if hit is None:
        raise ValueError(f"device_name {device_name!r} has no known peak; set peak_tflops in the recipe")
    return hit[0], f"table: {device_name} ({hit[1]})"

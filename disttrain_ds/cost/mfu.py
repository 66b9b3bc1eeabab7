"""Model FLOPs utilisation: achieved training FLOPs over the GPUs' peak, per module and
overall. All MFU values are fractions (0.52 means 52%)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _check(flops: float, gpus: int, peak_tflops: float, step_seconds: float, gpus_name: str) -> None:
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops}")
    if int(gpus) != gpus or gpus <= 0:
        raise ValueError(f"{gpus_name} must be a positive integer, got {gpus!r}")
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be positive, got {peak_tflops}")
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")


def tflops_per_gpu(flops: float, gpus: int, step_seconds: float) -> float:
    """Achieved TFLOP/s per GPU: ``flops`` done by ``gpus`` GPUs in ``step_seconds``."""
    _check(flops, gpus, 1.0, step_seconds, "gpus")
    return flops / gpus / step_seconds / 1e12


def module_mfu(flops: float, gpus: int, peak_tflops: float, step_seconds: float) -> float:
    """MFU of one module: its training FLOPs of a step over the peak of the GPUs it runs on."""
    _check(flops, gpus, peak_tflops, step_seconds, "gpus")
    return tflops_per_gpu(flops, gpus, step_seconds) / peak_tflops


def overall_mfu(total_flops: float, world: int, peak_tflops: float, step_seconds: float) -> float:
    """MFU of the whole model: all modules' training FLOPs of a step over all ``world`` GPUs."""
    _check(total_flops, world, peak_tflops, step_seconds, "world")
    return tflops_per_gpu(total_flops, world, step_seconds) / peak_tflops


@dataclass(frozen=True)
class StepFlops:
    """Training FLOPs of one optimizer step (all micro-batches, all data-parallel replicas), per
    module of the graph, already scaled for frozen modules (see ``training_flops``)."""

    modules: dict[str, float] = field(default_factory=dict)
    """Module name -> its FLOPs (an encoder and a generator with their projectors), in graph order."""

    def __post_init__(self) -> None:
        for name, flops in self.modules.items():
            if not flops >= 0:
                raise ValueError(f"FLOPs of module {name} must be >= 0, got {flops}")

    @property
    def total(self) -> float:
        """Sum over the modules."""
        return sum(self.modules.values())

    def metrics(self, *, gpus: dict[str, int], peak_tflops: float, step_seconds: float,
                world: int | None = None) -> dict[str, float]:
        """``perf/mfu/<module>`` and ``perf/tflops_per_gpu/<module>`` for each module, and ``.../overall``.

        ``gpus``: module name -> the GPUs it runs on; ``world`` defaults to their sum (disaggregated
        placement): pass it when modules share GPUs.
        """
        out: dict[str, float] = {}
        for name, flops in self.modules.items():
            n = gpus.get(name, 0)
            _check(flops, n, peak_tflops, step_seconds, f"gpus[{name!r}]")
            out[f"perf/mfu/{name}"] = module_mfu(flops, n, peak_tflops, step_seconds)
            out[f"perf/tflops_per_gpu/{name}"] = tflops_per_gpu(flops, n, step_seconds)
        world = sum(gpus.get(n, 0) for n in self.modules) if world is None else world
        out["perf/mfu/overall"] = overall_mfu(self.total, world, peak_tflops, step_seconds)
        out["perf/tflops_per_gpu/overall"] = tflops_per_gpu(self.total, world, step_seconds)
        return out

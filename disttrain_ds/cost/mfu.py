"""Model FLOPs utilisation: achieved training FLOPs over the GPUs' peak, per module and
overall. All MFU values are fractions (0.52 means 52%)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from disttrain_ds.graph import MODULES


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
    """Training FLOPs of one optimizer step (all micro-batches, all data-parallel
    replicas), per module, already scaled for frozen modules (see ``training_flops``)."""

    encoder: float = 0.0
    """Modality encoder (ViT) plus input projector."""
    llm: float = 0.0
    """LLM backbone, including its LM head."""
    generator: float = 0.0
    """Output projector plus diffusion U-Net generator."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")

    @property
    def total(self) -> float:
        """Sum over the three modules."""
        return self.encoder + self.llm + self.generator

    def metrics(
        self, *, encoder_gpus: int, llm_gpus: int, generator_gpus: int, peak_tflops: float,
        step_seconds: float, world: int | None = None,
    ) -> dict[str, float]:
        """``perf/mfu/{encoder,llm,generator,overall}`` and ``perf/tflops_per_gpu/{...}``.

        ``world`` defaults to the sum of the modules' GPUs (disaggregated placement); pass
        it when modules share GPUs. A module with 0 FLOPs and 0 GPUs is left out.
        """
        gpus = {"encoder": encoder_gpus, "llm": llm_gpus, "generator": generator_gpus}
        out: dict[str, float] = {}
        for name in MODULES:
            flops = getattr(self, name)
            if flops == 0 and gpus[name] == 0:
                continue  # module absent from this model
            _check(flops, gpus[name], peak_tflops, step_seconds, f"{name}_gpus")
            out[f"perf/mfu/{name}"] = module_mfu(flops, gpus[name], peak_tflops, step_seconds)
            out[f"perf/tflops_per_gpu/{name}"] = tflops_per_gpu(flops, gpus[name], step_seconds)
        world = sum(gpus.values()) if world is None else world
        out["perf/mfu/overall"] = overall_mfu(self.total, world, peak_tflops, step_seconds)
        out["perf/tflops_per_gpu/overall"] = tflops_per_gpu(self.total, world, step_seconds)
        return out

"""Peak-throughput table, CPU estimate, peak resolution and MFU arithmetic."""

from __future__ import annotations

import pytest

from disttrain_ds.cost import peak
from disttrain_ds.cost.mfu import StepFlops, module_mfu, overall_mfu, tflops_per_gpu
from disttrain_ds.cost.peak import lookup_peak_tflops, measure_cpu_peak_tflops, resolve_peak
from disttrain_ds.paper import load_paper_figures


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A800-SXM4-80GB", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("nvidia h200", 989.0),
    ("NVIDIA H20", 148.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0),
    ("NVIDIA A10", 125.0),
    ("Tesla V100-SXM2-32GB", 125.0),
    ("AMD Instinct MI300X", 1307.4),
])
def test_device_names_map_to_their_dense_peak(name, tflops):
    assert lookup_peak_tflops(name) == tflops


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Intel Gaudi2", "NVIDIA A1000"])
def test_names_that_only_share_a_prefix_with_a_known_device_are_unknown(name):
    assert lookup_peak_tflops(name) is None


def test_table_agrees_with_the_papers_a800_peak():
    paper = load_paper_figures()["hardware"]
    assert lookup_peak_tflops(paper["gpu"]) == paper["bf16_peak_tflops"]


def test_cpu_peak_is_measured_once_and_cached(monkeypatch):
    first = measure_cpu_peak_tflops(size=64, repeats=1)
    assert 0 < first < 1e3

    def fail(*args, **kwargs):
        raise AssertionError("matmul re-timed despite the cache")

    monkeypatch.setattr(peak, "_time_matmul", fail)
    assert measure_cpu_peak_tflops(size=64, repeats=1) == first
    with pytest.raises(AssertionError, match="re-timed"):
        measure_cpu_peak_tflops(size=32, repeats=1)


def test_resolve_peak_prefers_override_then_table_then_cpu_estimate(monkeypatch):
    assert resolve_peak(400.0, "NVIDIA H100 80GB HBM3") == (400.0, "recipe override")
    tflops, source = resolve_peak(None, "NVIDIA H100 80GB HBM3")
    assert tflops == 989.0 and source.startswith("table: NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(peak, "measure_cpu_peak_tflops", lambda: 0.5)
    assert resolve_peak(None, None) == (0.5, "measured CPU matmul estimate")
    assert resolve_peak(None, "cpu") == (0.5, "measured CPU matmul estimate")


@pytest.mark.parametrize("call,match", [
    (lambda: resolve_peak(None, "Mystery Accelerator 9000"), "device_name"),
    (lambda: resolve_peak(0.0, None), "override"),
    (lambda: measure_cpu_peak_tflops(size=0), "size"),
    (lambda: module_mfu(1.0, 0, 312.0, 1.0), "gpus"),
    (lambda: overall_mfu(1.0, 8, 312.0, 0.0), "step_seconds"),
    (lambda: module_mfu(1.0, 8, -1.0, 1.0), "peak_tflops"),
    (lambda: StepFlops({"llm": -1.0}), "llm"),
    (lambda: StepFlops({"vision": 1.0, "painter": 1.0}).metrics(gpus={"vision": 1}, peak_tflops=1.0,
                                                                step_seconds=1.0), "painter"),
])
def test_bad_arguments_raise_value_error_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_module_mfu_is_flops_over_gpus_peak_and_time():
    # 8 GPUs at 312 TFLOP/s for 2 s can do 4.992e15 FLOPs; half of that is 50% MFU.
    assert module_mfu(2.496e15, 8, 312.0, 2.0) == pytest.approx(0.5)
    assert overall_mfu(2.496e15, 16, 312.0, 2.0) == pytest.approx(0.25)
    assert tflops_per_gpu(2.496e15, 8, 2.0) == pytest.approx(156.0)


def test_step_flops_metrics_report_each_module_on_its_own_gpus():
    step = StepFlops({"vision": 1e15, "ear": 2e15, "llm": 6e15, "painter": 3e15})
    out = step.metrics(gpus={"vision": 2, "ear": 1, "llm": 8, "painter": 4}, peak_tflops=100.0, step_seconds=10.0)
    assert out == pytest.approx({
        "perf/mfu/vision": 0.5, "perf/mfu/ear": 2.0, "perf/mfu/llm": 0.75, "perf/mfu/painter": 0.75,
        "perf/mfu/overall": 12e15 / (15 * 100e12 * 10),
        "perf/tflops_per_gpu/vision": 50.0, "perf/tflops_per_gpu/ear": 200.0, "perf/tflops_per_gpu/llm": 75.0,
        "perf/tflops_per_gpu/painter": 75.0, "perf/tflops_per_gpu/overall": 12e15 / 15 / 10 / 1e12,
    })


def test_step_flops_overall_uses_given_world_when_modules_share_gpus():
    out = StepFlops({"llm": 8e15}).metrics(gpus={"llm": 8}, peak_tflops=100.0, step_seconds=10.0, world=16)
    assert set(out) == {"perf/mfu/llm", "perf/tflops_per_gpu/llm", "perf/mfu/overall",
                        "perf/tflops_per_gpu/overall"}
    assert out["perf/mfu/overall"] == pytest.approx(0.5 * out["perf/mfu/llm"])

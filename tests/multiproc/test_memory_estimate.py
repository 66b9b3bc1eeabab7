"""The runtime's memory estimate against what a training job really holds (torchrun on CPU).

Measured with ``bench/memory_probe.py`` on every rank: the most bytes the C allocator had handed
out at once (sampled every millisecond; on CPU the counterpart of ``max_memory_allocated``),
above the rank's own baseline once its libraries are imported, for the tiny recipe scaled up minus
the plain tiny recipe. Both numbers are per process and do not move with the machine's load
(peak resident memory does: freed tensors glibc keeps, pages the kernel reclaims).
"""

from __future__ import annotations

import importlib.util

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow

TOLERANCE = 0.15


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", REPO / "bench" / "bench_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llm_estimate_is_within_15_percent_of_its_measured_peak_in_the_readme_layout():
    bench = _bench()
    ranks, overrides = bench.LAYOUTS["README (LLM PP 2)"]
    big = bench.measured(ranks, bench.SCALED + overrides, 2, glibc_default=False)
    small = bench.measured(ranks, overrides, 2, glibc_default=False)
    where = bench.modules_of(overrides)["llm"]
    live = max(bench.above_baseline(big[r])[0] - bench.above_baseline(small[r])[0] for r in where)
    est = bench.estimated(bench.SCALED + overrides)["llm"] - bench.estimated(overrides)["llm"]
    assert live > 40 * 2**20  # the scaled LLM's memory stands well out of the baseline
    assert abs(est - live) <= TOLERANCE * live, (est / 2**20, live / 2**20)
    # Negative control: the estimate with about one microbatch in flight instead of the ones 1F1B
    # keeps misses the measured peak by far more than the tolerance.
    from disttrain_ds.estimate.memory import estimate
    from disttrain_ds.recipe.schema import load_recipe

    def one_in_flight(ov):
        rows = [r for r in estimate(load_recipe("tiny_cpu", ov)) if r.module == "llm"]
        return max(r.total - r.activations * (r.in_flight - 1) / r.in_flight for r in rows)

    lean = one_in_flight(bench.SCALED + overrides) - one_in_flight(overrides)
    assert abs(lean - live) > TOLERANCE * live

"""The single-process reference trainer: learns, logs one record per step, keeps old runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain_ds.metrics.rundir import make_run_dir
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.reference import train_reference

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


def test_reference_loss_goes_down_over_20_steps(tmp_path):
    recipe = load_recipe(TINY, ["train.steps=20"])
    records, _ = train_reference(recipe, tmp_path, log=None)
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, losses
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    for key in ("loss", "loss/lm", "loss/gen", "step_seconds", "samples_per_s", "tokens_per_s", "time/data_wait", "data/batch_mib"):
        assert all(key in r for r in rows), key
    for r in rows:
        mfu = [r[f"perf/mfu/{m}"] for m in ("encoder", "llm", "generator")]
        assert all(0 < v < 1 for v in mfu) and r["perf/mfu/overall"] == pytest.approx(sum(mfu))


def test_same_seed_same_losses_different_seed_different():
    a, _ = train_reference(load_recipe(TINY, ["train.steps=2"]), None, log=None)
    b, _ = train_reference(load_recipe(TINY, ["train.steps=2"]), None, log=None)
    c, _ = train_reference(load_recipe(TINY, ["train.steps=2", "seed=7"]), None, log=None)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a] != [r["loss"] for r in c]


def _encoder_before_after(overrides: list[str]):
    from disttrain_ds.mllm.model import ReferenceMLLM
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe(TINY, ["train.steps=2", *overrides])
    _, spec = build_data_and_spec(recipe)
    before = {k: v.clone() for k, v in ReferenceMLLM(spec).encoder.state_dict().items()}
    _, model = train_reference(recipe, None, log=None)
    after = model.encoder.state_dict()
    changed = {k for k in before if not torch_equal(before[k], after[k])}
    return before.keys(), changed


def test_frozen_encoder_keeps_its_weights_and_trains_only_its_projector():
    projector = "layers.4."  # embed, block0, block1, head, projector
    keys, changed = _encoder_before_after(["model.encoder.frozen=true"])
    assert changed and all(k.startswith(projector) for k in changed)
    assert {k for k in keys if k.startswith(projector)} == changed
    # Projector frozen as well: nothing of the encoder moves.
    _, changed = _encoder_before_after(["model.encoder.frozen=true", "model.encoder.projector.frozen=true"])
    assert not changed


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_existing_run_dir_is_never_overwritten(tmp_path):
    first = make_run_dir(str(tmp_path / "run"), "x")
    (first / "metrics.jsonl").write_text("keep me\n")
    second = make_run_dir(str(tmp_path / "run"), "x")
    assert second != first and second.name == "run-2"
    assert (first / "metrics.jsonl").read_text() == "keep me\n"


def test_train_cli_reference_writes_metrics(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "train.py"), "--recipe", str(TINY), "train.steps=2",
         f"logging.dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step    2" in proc.stdout
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 2


def test_global_batch_loss_does_not_depend_on_microbatch_grouping(tiny_source_and_spec):
    """Reordering samples inside a global batch (what intra/inter reordering does) keeps the loss."""
    import torch

    from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate

    source, spec = tiny_source_and_spec
    samples = source.global_batch(3)
    model = ReferenceMLLM(spec)
    norms = BatchNorms.of(samples, chunks=2)

    def step_loss(order):
        s = [samples[i] for i in order]
        with torch.no_grad():
            return sum(float(model(collate(s[c * 2 : (c + 1) * 2], norms, spec))["loss"]) for c in range(2)) / 2

    base = step_loss([0, 1, 2, 3])
    for order in ([3, 1, 0, 2], [2, 3, 0, 1], [1, 2, 3, 0]):
        assert abs(step_loss(order) - base) <= 1e-6 * abs(base)
    # Per-microbatch means (the usual normalisation) would not have this property:
    per_mb = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        s = [samples[i] for i in order]
        vals = []
        for c in range(2):
            part = s[c * 2 : (c + 1) * 2]
            with torch.no_grad():
                vals.append(float(model(collate(part, BatchNorms.of(part, 1), spec))["lm"]))
        per_mb.append(sum(vals) / 2)
    assert abs(per_mb[0] - per_mb[1]) > 1e-6 * abs(per_mb[0])


def test_module_learning_rates_scale_each_modules_first_sgd_step():
    from disttrain_ds.mllm.model import ReferenceMLLM
    from disttrain_ds.runtime.reference import reference_layer_state
    from disttrain_ds.runtime.setup import build_data_and_spec

    base = ["train.steps=1", "optim.name=sgd", "optim.lr=0.01"]
    recipe = load_recipe(TINY, base)
    initial = reference_layer_state(ReferenceMLLM(build_data_and_spec(recipe)[1]))

    def delta(overrides):
        _, model = train_reference(load_recipe(TINY, [*base, *overrides]), None, log=None)
        after = reference_layer_state(model)
        return {k: after[k] - initial[k] for k in initial}

    plain = delta([])
    scaled = delta(["optim.module_lr.encoder=0.02", "optim.module_lr.encoder/projector=0.03"])
    for k, d in plain.items():
        factor = 3.0 if k.startswith("encoder/projector/") else 2.0 if k.startswith("encoder/") else 1.0
        assert torch_close(scaled[k], d * factor), k
        if d.norm() > 1e-4:  # well above float32 rounding of the weights themselves
            assert abs(float(scaled[k].norm() / d.norm()) - factor) < 1e-2 * factor, k
    assert any(d.abs().max() > 0 for k, d in plain.items() if k.startswith("encoder/projector/"))


def torch_close(a, b) -> bool:
    import torch

    return torch.allclose(a, b, rtol=1e-3, atol=5e-7)  # the weights' float32 rounding


def test_module_learning_rate_must_name_a_module_or_projector():
    import pytest

    from disttrain_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="'optim.module_lr.llm/projector' names no module or projector"):
        load_recipe(TINY, ["optim.module_lr.llm/projector=0.1"])
    with pytest.raises(ConfigError, match="'optim.module_lr.vision' names no module"):
        load_recipe(TINY, ["optim.module_lr.vision=0.1"])

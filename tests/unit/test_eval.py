"""Validation loss: a held-out split that never meets the training stream, ``eval.*`` checks, and
an evaluation that leaves training bit-identical (reference layout)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.split import TRAIN, Split, held_out_records, split_records
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.callbacks.evaluation import eval_due
from disttrain_ds.runtime.reference import train_reference
from disttrain_ds.samples import GenShape, ShapeSpec

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"
SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))


def _ids(batch) -> set[bytes]:
    return {s.input_ids.numpy().tobytes() for s in batch}


@pytest.mark.parametrize("source", ["synthetic", "paper_stats"])
def test_synthetic_held_out_batches_differ_from_every_training_batch(source):
    cfg = DataConfig(source=source, seq_len=96, image_sizes=[16], gen_images=[0, 1])
    train = build_source(cfg, SHAPE, 4, 3)
    held = build_source(cfg, SHAPE, 4, 3, Split(held_out=True))
    seen = set().union(*(_ids(train.global_batch(s)) for s in range(6)))
    for b in range(3):
        batch = held.global_batch(b)
        assert not _ids(batch) & seen
        assert all(s.sample_id >= 1 << 40 for s in batch)  # their diffusion noise is not a training sample's
    # Negative control: the comparison finds a batch the training stream does produce.
    assert _ids(build_source(cfg, SHAPE, 4, 3, TRAIN).global_batch(2)) <= seen


def test_held_out_records_are_a_fixed_share_whatever_the_seed():
    a = held_out_records(200, 0.1)
    assert len(a) == 20 and np.array_equal(a, held_out_records(200, 0.1))
    assert len(held_out_records(5, 0.01)) == 1  # at least one record when the fraction is above 0
    train, held = split_records(200, Split(fraction=0.1)), split_records(200, Split(held_out=True, fraction=0.1))
    assert not set(train) & set(held) and len(train) + len(held) == 200
    assert np.array_equal(split_records(7, TRAIN), np.arange(7))
    with pytest.raises(ValueError, match="eval.holdout_fraction: .* leaves none to train on"):
        held_out_records(3, 0.9)


def _pairs(tmp_path: Path, n: int) -> Path:
    (tmp_path / "images").mkdir()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(tmp_path / "images" / "red.png")
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"image": "images/red.png", "caption": f"Caption {i}.", "generate": False}) + "\n")
    return tmp_path


def test_record_training_stream_never_reads_a_held_out_record(tmp_path):
    cfg = DataConfig(source="local", path=str(_pairs(tmp_path, 20)), seq_len=64, image_sizes=[16], gen_images=[0, 1])
    split = Split(fraction=0.25)
    held = set(split_records(20, Split(held_out=True, fraction=0.25)).tolist())
    records = lambda batch: {r for s in batch for _, r in s.meta["records"]}  # noqa: E731
    trained = set().union(*(records(build_source(cfg, SHAPE, 2, 0, split).global_batch(s)) for s in range(12)))
    evaluated = set().union(*(records(build_source(cfg, SHAPE, 2, 0, Split(True, 0.25)).global_batch(s))
                              for s in range(3)))
    assert len(held) == 5 and trained == set(range(20)) - held and evaluated == held
    # Without a hold-out the training stream reads every record (what the check above would miss).
    everything = set().union(*(records(build_source(cfg, SHAPE, 2, 0).global_batch(s)) for s in range(12)))
    assert everything == set(range(20))


@pytest.mark.parametrize("override, message", [
    ("eval.every=-1", "'eval.every' must be >= 0"),
    ("eval.batches=0", "'eval.batches' must be >= 1"),
    ("eval.holdout_fraction=1.0", "'eval.holdout_fraction' must be in [0, 1)"),
    ("eval.holdout_fraction=0.1", "'eval.holdout_fraction' applies to record sources only"),
    ("eval.often=1", "unknown key 'eval.often'"),
])
def test_bad_eval_settings_fail_in_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_record_source_evaluation_needs_a_holdout_fraction(fixtures_dir):
    data = ["data.source=laion", f"data.path={fixtures_dir / 'laion_captions.jsonl'}"]
    with pytest.raises(ConfigError, match="'eval.holdout_fraction' must be > 0 to evaluate on data.source laion"):
        load_recipe(TINY, [*data, "eval.every=2"])
    assert load_recipe(TINY, [*data, "eval.every=2", "eval.holdout_fraction=0.05"]).eval.holdout_fraction == 0.05


def test_eval_runs_every_n_steps_and_after_the_last():
    assert [s for s in range(1, 8) if eval_due(s, 3, 7)] == [3, 6, 7]
    assert not any(eval_due(s, 0, 7) for s in range(1, 8))


def test_evaluation_leaves_training_losses_bit_identical_and_logs_eval_loss_per_module(tmp_path):
    steps = ["train.steps=4"]
    off, _ = train_reference(load_recipe(TINY, steps), None, log=None)
    on, _ = train_reference(load_recipe(TINY, [*steps, "eval.every=2", "eval.batches=2"]), tmp_path, log=None)
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["eval/loss"] == pytest.approx(r["eval/loss/llm"] + r["eval/loss/generator"], rel=1e-12)
        assert np.isfinite(r["eval/loss"]) and r["eval/loss"] != r["loss"]
    assert evals[1]["eval/loss"] < evals[0]["eval/loss"]  # the model learns; the held-out batches stay the same


def test_a_training_step_inside_evaluation_would_be_caught():
    """Negative control: an evaluation that also trains changes the training losses."""
    from disttrain_ds.runtime import reference

    original = reference.ReferenceExecutor.evaluate

    def evaluate_and_train(self, batches):
        self.train_step(0, batches[0], 0.0, 0.0)
        return original(self, batches)

    steps = ["train.steps=3"]
    off, _ = train_reference(load_recipe(TINY, steps), None, log=None)
    reference.ReferenceExecutor.evaluate = evaluate_and_train
    try:
        on, _ = train_reference(load_recipe(TINY, [*steps, "eval.every=1", "eval.batches=1"]), None, log=None)
    finally:
        reference.ReferenceExecutor.evaluate = original
    assert [r["loss"] for r in on][1:] != [r["loss"] for r in off][1:]


def _tar_shards(root: Path, n_shards: int, per_shard: int) -> str:
    """webdataset shards whose captions name their shard and item."""
    import io
    import tarfile

    root.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 10)).save(buf, format="JPEG")
    for s in range(n_shards):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                for name, data in ((f"{s:05d}{i:04d}.jpg", buf.getvalue()), (f"{s:05d}{i:04d}.txt", f"shard {s} item {i}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(root / ("{00000..%05d}.tar" % (n_shards - 1)))


@pytest.mark.parametrize("parts", [1, 2])
def test_shard_training_stream_never_reads_a_held_out_record(tmp_path, monkeypatch, parts):
    import re

    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(source="webdataset", path=_tar_shards(tmp_path / "shards", 4, 5), seq_len=64, image_sizes=[16],
                     gen_images=[0, 1], shard_parts=parts)

    def items(split: Split, steps: int) -> set[str]:
        src = build_source(cfg, SHAPE, 2, 0, split)
        text = [bytes(s.input_ids[s.input_ids < 256].tolist()).decode() for b in range(steps) for s in src.global_batch(b)]
        return {m for t in text for m in re.findall(r"shard \d+ item \d+", t)}

    trained, held = items(Split(fraction=0.2), 10), items(Split(held_out=True, fraction=0.2), 3)
    assert held and trained and not trained & held
    assert held <= items(TRAIN, 10)  # without a hold-out, training reads those very records

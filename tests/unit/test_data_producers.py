"""Disaggregated preprocessing: producer processes deliver the in-process batches, in step order."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import ProducerError, build_source
from disttrain_ds.reorder.inter import reorder_batch
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))


def mmc4(fixtures_dir, **kw) -> DataConfig:
    path = fixtures_dir / "mmc4_sample.jsonl"
    return DataConfig(**{"source": "mmc4", "path": str(path), "seq_len": 256, "image_sizes": [16, 32], **kw})


def same(a, b) -> bool:
    return all(
        torch.equal(x.input_ids, y.input_ids) and all(torch.equal(u, v) for u, v in zip(x.gen_targets, y.gen_targets))
        and len(x.images) == len(y.images) and all(torch.equal(p, q) for p, q in zip(x.images, y.images))
        for x, y in zip(a, b, strict=True)
    )


def test_two_producers_deliver_the_in_process_batches_in_step_order(fixtures_dir):
    cfg = mmc4(fixtures_dir)
    local = build_source(cfg, SHAPE, 4, 11)
    want = [local.global_batch(s) for s in range(5)]
    with build_source(dataclasses.replace(cfg, producers=2, queue_depth=2), SHAPE, 4, 11) as src:
        for step in range(5):
            assert same(src.global_batch(step), want[step]), step
            assert src.last_wait_seconds >= 0.0
        procs = list(src._procs)
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
        assert src.state_dict()["inner"] == local.state_dict()["inner"]
        assert src.skip_counts() == local.skip_counts()
    assert src._procs == [] and not any(p.is_alive() for p in procs)  # closed: no orphans


def test_producers_restart_from_a_saved_state(fixtures_dir):
    cfg = dataclasses.replace(mmc4(fixtures_dir), producers=1)
    local = build_source(mmc4(fixtures_dir), SHAPE, 4, 11)
    want = [local.global_batch(s) for s in range(4)]
    with build_source(cfg, SHAPE, 4, 11) as src:
        src.global_batch(0), src.global_batch(1)
        state = src.state_dict()
    with build_source(cfg, SHAPE, 4, 11) as resumed:
        resumed.load_state_dict(state)
        assert same(resumed.global_batch(2), want[2]) and same(resumed.global_batch(3), want[3])


def test_producer_exception_is_raised_in_the_trainer_as_one_line(fixtures_dir):
    # reorder needs dp_size * micro_batch to divide the batch: 3 samples over 2 ranks fails in the producer.
    shape = dataclasses.replace(SHAPE, dp_size=2, micro_batch=1)
    cfg = dataclasses.replace(mmc4(fixtures_dir), producers=1, reorder=True)
    src = build_source(cfg, shape, 3, 0)
    with pytest.raises(ProducerError) as err:
        src.global_batch(0)
    msg = str(err.value)
    assert msg.startswith("data.producers: producer 0 failed at step 0: ValueError: data.reorder:") and "\n" not in msg
    assert "Traceback" in err.value.details
    assert src._procs == []


def test_killed_producer_is_reported_instead_of_hanging():
    cfg = DataConfig(producers=2, queue_depth=2)  # synthetic: no fixtures needed
    with build_source(cfg, SHAPE, 2, 0) as src:
        src.global_batch(0)
        victim = src._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        with pytest.raises(ProducerError, match=r"^data.producers: producer 1 exited \(code -9\)"):
            for step in range(1, 12):  # anything it queued before dying still arrives first
                src.global_batch(step)


def test_reorder_keeps_the_samples_and_balances_dp_ranks(fixtures_dir):
    from disttrain_ds.cost.model import CostModel

    # Cost = encoder patches + 20 per generated image, so the caption-pair samples differ clearly.
    cost = CostModel(enc_per_patch=1.0, enc_per_patch_sq=0.0, llm_per_token=0.0, llm_per_doc_token_sq=0.0,
                     gen_per_latent=0.0, gen_per_latent_sq=0.0, gen_per_image=20.0)
    shape = dataclasses.replace(SHAPE, dp_size=2, micro_batch=2, cost_model=cost)
    laion = DataConfig(source="laion", path=str(fixtures_dir / "laion_captions.jsonl"), seq_len=256,
                       image_sizes=[16, 32], gen_images=[0, 2])
    src = build_source(laion, shape, 8, 3)

    def load(s) -> float:
        return cost.train_cost(s.stats(8, src.special))

    def worst_ranks(samples) -> float:  # microbatches of 2 ranks x 2 samples; the slower rank counts
        loads = [load(samples[i]) + load(samples[i + 1]) for i in range(0, 8, 2)]
        return max(loads[0], loads[1]) + max(loads[2], loads[3])

    batch = src.global_batch(0)
    assert len({round(load(s)) for s in batch}) > 2
    heavy_first = sorted(batch, key=load, reverse=True)  # the two heaviest share a rank: unbalanced
    out = reorder_batch(heavy_first, shape, src.special)
    assert sorted(s.sample_id for s in out) == sorted(s.sample_id for s in batch)
    assert worst_ranks(out) < worst_ranks(heavy_first)
    out = reorder_batch(batch, shape, src.special)
    reordered = build_source(dataclasses.replace(laion, reorder=True), shape, 8, 3).global_batch(0)
    assert [s.sample_id for s in reordered] == [s.sample_id for s in out]

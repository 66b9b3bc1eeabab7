"""Real-record sources on the MMC4 and LAION fixtures: validity, determinism, resume, no fallback."""

from __future__ import annotations

import pytest
import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.images import ImageRef, load_image
from disttrain_ds.data.producers import build_source
from disttrain_ds.data.source import SyntheticSource
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.samples import GenShape, ShapeSpec

SHAPE = ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),))
BATCH = 4
FIXTURE_FILES = {"mmc4": "mmc4_sample.jsonl", "laion": "laion_captions.jsonl"}


def cfg_for(fixtures_dir, source: str, **kw) -> DataConfig:
    path = fixtures_dir / FIXTURE_FILES[source]
    return DataConfig(**{"source": source, "path": str(path), "seq_len": 256, "image_sizes": [16, 32], **kw})


def batches(cfg: DataConfig, steps, seed: int = 7):
    src = build_source(cfg, SHAPE, BATCH, seed)
    return src, [src.global_batch(s) for s in steps]


def assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert len(x.images) == len(y.images) and all(torch.equal(p, q) for p, q in zip(x.images, y.images))
        assert all(torch.equal(u, v) for u, v in zip(x.gen_targets, y.gen_targets))
        assert (x.sample_id, x.doc_lens) == (y.sample_id, y.doc_lens)


@pytest.mark.parametrize("source, tokenizer", [("mmc4", "byte"), ("mmc4", "smollm2"), ("laion", "smollm2")])
def test_fixture_sources_give_valid_packed_samples(fixtures_dir, source, tokenizer):
    src, out = batches(cfg_for(fixtures_dir, source, tokenizer=tokenizer), range(4))
    samples = [s for b in out for s in b]
    assert len(samples) == 4 * BATCH
    for s in samples:
        assert sample_problems(s, src.special, 8, 256, (GenShape(16, 3, 4),)) == []
    assert sum(len(s.images) for s in samples) > 0
    assert sum(int(s.gen_targets[0].shape[0]) for s in samples) > 0
    sides = {im.shape[1] for s in samples for im in s.images} | {im.shape[2] for s in samples for im in s.images}
    assert sides == {16, 32}  # sizes drawn per image from data.image_sizes
    assert [s.sample_id for s in samples] == list(range(4 * BATCH))
    assert src.special.vocab_size == (49152 if tokenizer == "smollm2" else 256) + 6


def test_urls_get_real_photographs_deterministically(fixtures_dir):
    _, (batch,) = batches(cfg_for(fixtures_dir, "mmc4"), [0])
    images = [im for s in batch for im in s.images] + [g for s in batch for g in s.gen_targets[0]]
    assert images
    for im in images:  # natural photos: spread-out pixels, not a flat or smooth synthetic field
        assert float(im.std()) > 0.05 and float(im.min()) >= -1 and float(im.max()) <= 1
    a, b = ImageRef("photo", "http://example.com/a.jpg"), ImageRef("photo", "http://example.com/b.jpg")
    assert torch.equal(load_image(a, 32, 48), load_image(a, 32, 48))
    assert load_image(a, 32, 48).shape == (3, 32, 48)
    assert not torch.equal(load_image(a, 32, 48), load_image(b, 32, 48))


def test_laion_pairs_go_both_directions(fixtures_dir):
    src, out = batches(cfg_for(fixtures_dir, "laion", gen_prob=0.5, gen_images=[0, 2]), range(2))
    sp = src.special
    firsts = set()
    for s in (s for b in out for s in b):
        start = 0
        for n in s.doc_lens:
            doc = s.input_ids[start:start + n]
            start += n
            firsts.add("image" if int(doc[0]) == sp.boi and int(doc[1]) == sp.image else "text")
            if int(doc[0]) != sp.boi:  # caption first: the image after it is generated
                assert int(doc[-2]) == sp.eoi and int(doc[-3]) == sp.gen
    assert firsts == {"image", "text"}


def test_same_seed_gives_identical_batches_and_another_seed_differs(fixtures_dir):
    cfg = cfg_for(fixtures_dir, "mmc4")
    _, a = batches(cfg, [0, 3])
    _, b = batches(cfg, [0, 3])
    for x, y in zip(a, b):
        assert_same(x, y)
    _, c = batches(cfg, [0], seed=8)
    assert not torch.equal(a[0][0].input_ids, c[0][0].input_ids)


def test_random_access_equals_sequential_order(fixtures_dir):
    cfg = cfg_for(fixtures_dir, "laion")
    _, seq = batches(cfg, range(4))
    _, jump = batches(cfg, [3])
    assert_same(seq[3], jump[0])


def test_resume_from_state_matches_the_uninterrupted_run(fixtures_dir):
    cfg = cfg_for(fixtures_dir, "mmc4", shuffle=True)
    run, full = batches(cfg, range(6))
    first, _ = batches(cfg, range(3))
    state = first.state_dict()
    assert state["next_step"] == 3
    resumed = build_source(cfg, SHAPE, BATCH, 7)
    resumed.load_state_dict(state)
    for step in range(3, 6):
        assert_same(resumed.global_batch(step), full[step])
    # The restored cursor is used: the records before step 3 are not read again.
    assert resumed.inner.records_parsed < run.inner.records_parsed
    assert resumed.state_dict()["inner"] == run.state_dict()["inner"]


def test_state_from_another_data_setup_is_rejected(fixtures_dir):
    src, _ = batches(cfg_for(fixtures_dir, "mmc4"), [0])
    other = build_source(cfg_for(fixtures_dir, "mmc4", seq_len=128), SHAPE, BATCH, 7)
    with pytest.raises(ValueError, match="^data: .*different data setup"):
        other.load_state_dict(src.state_dict())


@pytest.mark.parametrize("source", ["mmc4", "laion", "local"])
def test_a_record_source_without_a_path_is_a_one_line_error_not_synthetic_data(source):
    with pytest.raises(ValueError, match=f"^data.path: data.source {source} reads .*set data.path to") as exc:
        build_source(DataConfig(source=source), SHAPE, BATCH, 0)
    assert "\n" not in str(exc.value)


def test_explicit_missing_path_is_an_error_naming_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="^data.path: "):
        build_source(DataConfig(source="laion", path=str(tmp_path / "nope.jsonl")), SHAPE, BATCH, 0)


def test_image_sizes_must_be_patch_multiples(fixtures_dir):
    with pytest.raises(ValueError, match="^data.image_sizes: 20 "):
        build_source(cfg_for(fixtures_dir, "laion", image_sizes=[16, 20]), SHAPE, BATCH, 0)


def test_default_recipe_settings_still_use_the_synthetic_source():
    src = build_source(DataConfig(), SHAPE, BATCH, 0)
    assert isinstance(src.inner, SyntheticSource) and src.skip_counts() == {}

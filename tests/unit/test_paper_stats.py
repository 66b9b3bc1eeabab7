"""Synthetic layouts follow the paper's LAION-400M subsequence statistics (Fig. 5)."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain_ds.data import paper_stats as ps
from disttrain_ds.data.paper_stats import Subsequence, draw_sample_stats, draw_sequence_layouts, layout_to_stats
from disttrain_ds.paper import load_paper_figures


@pytest.fixture(scope="module")
def layouts_8k():
    return draw_sequence_layouts(1500, 8192, np.random.default_rng(0))


def _tokens(layouts, kind):
    return np.array([s.tokens for lay in layouts for s in lay if s.kind == kind])


def _within(values, published, rel):
    q = np.percentile(values, [50, 90, 99])
    want = np.array([published["median"], published["p90"], published["p99"]])
    assert np.all(np.abs(q - want) <= rel * want + 1.0), (q, want)
    assert values.max() <= published["max"]


def test_constants_match_the_paper_figures():
    paper = load_paper_figures()
    fig5 = paper["laion400m_subsequence_stats_fig5"]
    assert fig5["text_tokens"] == ps.LAION_TEXT_TOKENS
    assert fig5["image_tokens"] == ps.LAION_IMAGE_TOKENS
    assert fig5["images_per_8k_sequence"] == ps.LAION_IMAGES_PER_8K
    assert paper["sequence_length"] == ps.REFERENCE_SEQ_LEN


def test_drawn_text_quantiles_match_published(layouts_8k):
    _within(_tokens(layouts_8k, "text"), ps.LAION_TEXT_TOKENS, rel=0.1)


def test_drawn_image_quantiles_match_published(layouts_8k):
    _within(_tokens(layouts_8k, "image"), ps.LAION_IMAGE_TOKENS, rel=0.1)


def test_drawn_images_per_sequence_match_published(layouts_8k):
    counts = np.array([sum(s.kind == "image" for s in lay) for lay in layouts_8k])
    _within(counts, ps.LAION_IMAGES_PER_8K, rel=0.1)
    assert counts.min() >= 1


def test_every_layout_fits_and_alternates_image_and_caption(layouts_8k):
    for lay in layouts_8k:
        assert sum(s.tokens for s in lay) <= 8192
        assert [s.kind for s in lay] == ["image", "text"] * (len(lay) // 2)
        assert all(s.tokens >= 1 for s in lay)


def test_image_count_scales_with_sequence_length():
    lays = draw_sequence_layouts(800, 16384, np.random.default_rng(1))
    counts = [sum(s.kind == "image" for s in lay) for lay in lays]
    assert abs(np.median(counts) - 18) <= 2
    assert all(sum(s.tokens for s in lay) <= 16384 for lay in lays)


def test_short_sequences_still_fit():
    for lay in draw_sequence_layouts(200, 64, np.random.default_rng(2)):
        assert 1 <= sum(s.kind == "image" for s in lay) and sum(s.tokens for s in lay) <= 64


def test_draws_are_reproducible_from_the_generator_seed():
    a = draw_sequence_layouts(20, 8192, np.random.default_rng(42))
    b = draw_sequence_layouts(20, 8192, np.random.default_rng(42))
    assert a == b and a != draw_sequence_layouts(20, 8192, np.random.default_rng(43))


def test_quantile_distribution_cdf_inverts_ppf():
    d = ps.IMAGE_DIST
    for u in (0.05, 0.3, 0.5, 0.9, 0.99):
        assert d.cdf(float(d.ppf(np.array([u]))[0])) == pytest.approx(u, abs=1e-9)
    truncated = d.sample_int(np.random.default_rng(0), 2000, upper=500)
    assert truncated.max() <= 500 and np.median(truncated) < 330


def test_layout_to_stats_documents_patches_and_generation():
    lay = [Subsequence("text", 5), Subsequence("image", 256), Subsequence("text", 20),
           Subsequence("image", 64), Subsequence("text", 10)]
    s = layout_to_stats(lay, 1024, patch_size=16, gen_fraction=0.5, gen_resolution=256)
    assert s.text_tokens == 35 and s.image_patches == (256, 64) and s.seq_len == 1024
    assert s.doc_lens == (5, 276, 74) and s.gens == ((1, 256),)
    # 14-pixel patches cover the same pixels with (16/14)^2 more patches
    s14 = layout_to_stats(lay, 1024, patch_size=14)
    assert s14.image_patches == (round(256 * (16 / 14) ** 2), round(64 * (16 / 14) ** 2))
    assert s14.gen(0)[0] == 2 and s14.doc_lens == s.doc_lens


def test_layout_to_stats_rejects_bad_arguments():
    lay = [Subsequence("image", 100)]
    with pytest.raises(ValueError, match="seq_len"):
        layout_to_stats(lay, 50)
    with pytest.raises(ValueError, match="gen_fraction"):
        layout_to_stats(lay, 200, gen_fraction=1.5)
    with pytest.raises(ValueError, match="subsequence"):
        layout_to_stats([Subsequence("audio", 3)], 200)
    with pytest.raises(ValueError, match="seq_len"):
        draw_sequence_layouts(3, 1, np.random.default_rng(0))


def test_draw_sample_stats_is_consistent_with_layouts():
    stats = draw_sample_stats(50, 8192, np.random.default_rng(3), patch_size=16)
    for s in stats:
        assert s.seq_len == 8192 and sum(s.doc_lens) <= 8192
        assert sum(s.doc_lens) == s.text_tokens + sum(s.image_patches)
        assert s.gen(0)[0] == len(s.image_patches)


def _fill(layouts, seq_len: int, markers: int = 0) -> float:
    return float(np.mean([(sum(s.tokens for s in lay) + markers * len(lay) // 2) / seq_len for lay in layouts]))


def test_short_sequences_are_packed_as_densely_as_the_papers_8k_ones():
    from disttrain_ds.data.paper_stats import packed_layouts

    paper = _fill(draw_sequence_layouts(1500, 8192, np.random.default_rng(0)), 8192)  # about 0.74
    packed = packed_layouts(1500, 1024, np.random.default_rng(0), markers=3)
    assert all(sum(s.tokens for s in lay) + 3 * len(lay) // 2 <= 1024 for lay in packed)
    assert abs(_fill(packed, 1024, 3) - paper) < 0.1
    assert np.median([len(lay) // 2 for lay in packed]) >= 2
    # Scaling the 8K image counts instead leaves one pair and mostly padding.
    assert _fill(draw_sequence_layouts(1500, 1024, np.random.default_rng(0)), 1024) < paper - 0.25
    assert packed_layouts(3, 8192, np.random.default_rng(4)) == draw_sequence_layouts(3, 8192, np.random.default_rng(4))


def test_paper_stats_source_fills_1024_token_sequences_with_several_documents():
    from disttrain_ds.data.config import DataConfig
    from disttrain_ds.data.producers import build_source
    from disttrain_ds.samples import GenShape, ShapeSpec

    # Image-to-text pairs only: a text-to-image pair puts its caption and queries in the sequence,
    # not its image, so it takes less room than the layout gave it.
    cfg = DataConfig(source="paper_stats", seq_len=1024, max_images=30, gen_images=[0, 0], gen_prob=0.0)
    src = build_source(cfg, ShapeSpec(patch_size=16, gens=(GenShape(16, 3, 4),)), 16, seed=2)
    samples = [s for step in range(3) for s in src.global_batch(step)]
    used = [int((s.input_ids != src.special.pad).sum()) / 1024 for s in samples]
    assert np.mean(used) > 0.65
    assert np.mean([len(s.doc_lens) > 1 for s in samples]) > 0.5

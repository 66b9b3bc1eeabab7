"""``paper_stats`` source: synthetic sequences shaped like the paper's LAION-400M statistics.

Layouts (caption lengths, image token counts, images per sequence) come from
:func:`disttrain_ds.data.paper_stats.packed_layouts` (drawn jointly at 8K, packed pair by pair below), for each global batch
from a seed per step, so any step can be built directly. One image token is one encoder patch:
an image of ``t`` tokens becomes an ``a x b`` patch grid with ``a * b <= t`` as close to ``t`` as
a near-square grid allows. Each (image, caption) pair is one document; with probability
``data.gen_prob`` (and while ``data.gen_images[1]`` allows) the pair is text-to-image instead: the
caption, then generation queries for an image at the generator's resolution. Markers and ``eod``
are taken from the pair's budget (caption first, then image) so every sequence fits ``seq_len``.
Pixels are smooth synthetic images: this source is for scale and cost, not for learning.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.paper_stats import packed_layouts
from disttrain_ds.data.source import _WORDS, SampleSource, labels_for, smooth_image
from disttrain_ds.data.split import TRAIN, Split
from disttrain_ds.data.tokenizer import Tokenizer, load_tokenizer, special_tokens
from disttrain_ds.samples import PackedSample, ShapeSpec


def patch_grid(tokens: int) -> tuple[int, int]:
    """(rows, cols) of patches with rows * cols <= ``tokens``, closest to it, rows <= cols <= 4 * rows."""
    best = (1, 1)
    root = max(1, math.isqrt(tokens))
    for rows in range(root, max(1, root // 2) - 1, -1):
        cols = min(tokens // rows, 4 * rows)
        if rows * cols > best[0] * best[1]:
            best = (rows, cols)
    return best


class PaperStatsSource(SampleSource):
    """Packed samples whose layouts follow DistTrain's Fig. 5 statistics."""

    def __init__(self, cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, split: Split = TRAIN):
        if not 0.0 <= cfg.gen_prob <= 1.0:
            raise ValueError(f"data.gen_prob: must be in [0, 1], got {cfg.gen_prob}")
        self.cfg, self.shape, self.batch, self.seed, self.split = cfg, shape, global_batch, seed, split
        self.tokenizer: Tokenizer = load_tokenizer(cfg.tokenizer, cfg.cache_dir)
        self.base_vocab = self.tokenizer.vocab_size
        self.special = special_tokens(self.tokenizer)

    def describe(self) -> str:
        return f"paper_stats (LAION-400M layouts, seq_len {self.cfg.seq_len}, gen_prob {self.cfg.gen_prob})"

    def _text(self, rng: np.random.Generator, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += self.tokenizer.encode(" ".join(_WORDS[i] for i in rng.integers(len(_WORDS), size=16)) + " ")
        return ids[:n]

    def sample(self, layout, rng: np.random.Generator, sample_id: int) -> PackedSample:
        cfg, sh, sp = self.cfg, self.shape, self.special
        g = sh.gens[0]  # the first generator's targets (this source names no other)
        ids: list[int] = []
        images: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        doc_lens: list[int] = []
        pairs = [(layout[k].tokens, layout[k + 1].tokens) for k in range(0, len(layout) - 1, 2)]
        for img_tokens, text_tokens in pairs:
            room = cfg.seq_len - len(ids)
            generate = rng.random() < cfg.gen_prob and len(targets) < cfg.gen_images[1]
            if generate:
                text = min(text_tokens, room - g.query_tokens - 3)
                if text < 1:
                    break
                start = len(ids)
                ids += self._text(rng, text) + [sp.boi] + [sp.gen] * g.query_tokens + [sp.eoi, sp.eod]
                targets.append(smooth_image(rng, g.channels, g.resolution, g.resolution))
            else:
                text = min(text_tokens, room - 4)  # leave one patch, the markers and eod
                if text < 1 or len(images) >= cfg.max_images:
                    break
                rows, cols = patch_grid(min(img_tokens, room - text - 3))
                start = len(ids)
                ids += [sp.boi] + [sp.image] * (rows * cols) + [sp.eoi] + self._text(rng, text) + [sp.eod]
                images.append(smooth_image(rng, 3, rows * sh.patch_size, cols * sh.patch_size))
            doc_lens.append(len(ids) - start)
        ids += [sp.pad] * (cfg.seq_len - len(ids))
        t = torch.tensor(ids, dtype=torch.long)
        gen = torch.stack(targets) if targets else torch.zeros(0, g.channels, g.resolution, g.resolution)
        return PackedSample(t, labels_for(t, sp, doc_lens), images, [gen], sample_id, tuple(doc_lens), {"source": "paper_stats"})

    def global_batch(self, step: int) -> list[PackedSample]:
        rng = np.random.default_rng(self.split.seed(self.seed, step, 5))
        layouts = packed_layouts(self.batch, self.cfg.seq_len, rng, markers=3)  # boi, eoi, eod
        return [self.sample(lay, rng, self.split.sample_id(step * self.batch + i)) for i, lay in enumerate(layouts)]

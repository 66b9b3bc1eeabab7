"""Training and held-out splits of a source: evaluation data that never overlaps the training stream.

Synthetic sources (``synthetic``, ``paper_stats``) draw each step from a seeded generator; the
held-out split adds one more word, ``EVAL_TAG``, to that seed, so its samples come from a seed
space the training stream never draws from (numpy's ``SeedSequence`` pads a shorter seed with
zeros, and the tag is not zero). Record and shard sources hold out a fixed share of the records
(``eval.holdout_fraction``; with ``data.shard_parts`` each part of its own records), chosen by a permutation that depends only on the record count: the
same records whatever the seed, and taken out of the training stream whenever the fraction is
above 0 (whether or not evaluation runs), so switching ``eval.every`` never changes training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EVAL_TAG = 0x45564C
"""Extra seed word of the held-out split (never 0: a zero word would equal the training seed)."""
EVAL_SAMPLE_ID = 1 << 40
"""Held-out samples are numbered from here: their diffusion noise never repeats a training sample's."""


@dataclass(frozen=True)
class Split:
    """Which part of a source to read."""

    held_out: bool = False
    """The held-out (evaluation) part instead of the training part."""
    fraction: float = 0.0
    """Record sources: the share of records held out of training (0: none)."""

    def seed(self, *words: int) -> list[int]:
        """A synthetic source's generator seed for this split."""
        return [*words, EVAL_TAG] if self.held_out else list(words)

    def sample_id(self, index: int) -> int:
        return EVAL_SAMPLE_ID + index if self.held_out else index


TRAIN = Split()


def held_out_records(n: int, fraction: float) -> np.ndarray:
    """Sorted indices of the ``fraction`` of ``n`` records held out (at least one when above 0)."""
    if fraction <= 0:
        return np.zeros(0, dtype=np.int64)
    k = max(1, math.floor(fraction * n + 0.5))
    if k >= n:
        raise ValueError(f"eval.holdout_fraction: {fraction:g} of {n} records leaves none to train on")
    return np.sort(np.random.default_rng([EVAL_TAG, n]).permutation(n)[:k])


def split_records(n: int, split: Split) -> np.ndarray:
    """Indices of the records in ``split`` (all ``n`` for training without a hold-out)."""
    held = held_out_records(n, split.fraction)
    if split.held_out:
        if held.size == 0:
            raise ValueError("eval.holdout_fraction: must be > 0 to evaluate on a record source")
        return held
    return np.setdiff1d(np.arange(n), held) if held.size else np.arange(n)

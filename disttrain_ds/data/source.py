"""Sample sources: deterministic global batches of ``PackedSample`` for a step.

Every layout asks the source for ``global_batch(step)`` and gets the same samples in the same
order, which is what makes the reference, monolithic and disaggregated runs comparable.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from disttrain_ds.data.audio import synthetic_clip
from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.split import TRAIN, Split
from disttrain_ds.samples import IGNORE_INDEX, PackedSample, ShapeSpec, SpecialTokens

_WORDS = (
    "the a of and to in is was for on with as by at from that this it an be are image photo picture shows "
    "red green blue small large old new city river mountain dog cat bird tree house car street people man "
    "woman child sky water light dark white black yellow near under over beside two three many one"
).split()


class SampleSource:
    """Base class: a deterministic function from (seed, step) to a global batch."""

    special: SpecialTokens
    base_vocab: int
    last_wait_seconds: float = 0.0
    """Seconds the trainer spent in the last ``global_batch`` call waiting for data."""

    def global_batch(self, step: int) -> list[PackedSample]:
        raise NotImplementedError

    def units(self) -> list[list[int]] | None:
        """Global positions of each unit of a batch that can be read on its own (``read_units``);
        None: the batch is one stream, read whole."""
        return None

    def read_units(self, step: int, units: list[int]) -> dict[int, PackedSample]:
        """Global position -> sample of the given units of ``step`` (reading nothing else)."""
        raise NotImplementedError(f"{type(self).__name__} reads whole batches only")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__

    def skip_counts(self) -> dict[str, int]:
        """Records skipped so far, by reason (only sources that read records skip any)."""
        return {}

    def step_skips(self, step: int) -> tuple[dict[str, int], dict[str, int]]:
        """(skips while planning up to ``step``, cumulative; extra counts of ``step`` alone)."""
        return {}, {}

    def close(self) -> None:
        """Release processes and files; the source can still be used for in-process batches."""

    def __enter__(self) -> "SampleSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def labels_for(ids: torch.Tensor, special: SpecialTokens, doc_lens: Sequence[int] = ()) -> torch.Tensor:
    """label[i] = ids[i+1] when that next token is text (or a marker) of the same document;
    IGNORE elsewhere: before a placeholder, a query or padding, and at each document's last
    position (``doc_lens``), whose next token starts another document it cannot see."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    nxt = ids[1:]
    keep = ~special.no_label(nxt)
    labels[:-1] = torch.where(keep, nxt, torch.full_like(nxt, IGNORE_INDEX))
    ends = torch.tensor(list(doc_lens), dtype=torch.long).cumsum(0) - 1
    labels[ends[ends < len(ids)]] = IGNORE_INDEX
    return labels


def smooth_image(rng: np.random.Generator, channels: int, h: int, w: int) -> torch.Tensor:
    """A smooth random image in [-1, 1] (a few low-frequency gradients), cheap and learnable."""
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    chans = []
    for _ in range(channels):
        a, b, c, ph = rng.uniform(-1, 1, size=4)
        chans.append(np.tanh(a * np.sin(3 * xx + ph) + b * np.cos(3 * yy) + c))
    return torch.tensor(np.stack(chans), dtype=torch.float32)


class SyntheticSource(SampleSource):
    """Generated interleaved samples: word-like byte text, smooth images, one or more documents per
    fixed-length sequence."""

    def __init__(self, cfg: DataConfig, shape: ShapeSpec, global_batch: int, seed: int, split: Split = TRAIN):
        self.cfg, self.shape, self.batch, self.seed, self.split = cfg, shape, global_batch, seed, split
        self.base_vocab = 256
        self.special = SpecialTokens.after(self.base_vocab, audio=shape.audio_mels > 0,
                                           generators=len(shape.gens))

    def describe(self) -> str:
        audio = f", audio 1..{self.cfg.max_audio} clips of {self.cfg.audio_frames} frames" if self._audio() else ""
        return f"synthetic (seq_len {self.cfg.seq_len}, images {self.cfg.image_sizes} px{audio})"

    def _audio(self) -> bool:
        return self.shape.audio_mels > 0 and self.cfg.max_audio > 0

    def _clips(self, rng: np.random.Generator, ids: list[int], budget: int) -> list[torch.Tensor]:
        """1..max_audio seeded log-mel clips of even lengths, each as [boi] [audio x rows] [eoi] text."""
        cfg, sp = self.cfg, self.special
        clips = []
        lo, hi = (cfg.audio_frames[0] + 1) // 2, cfg.audio_frames[1] // 2
        for _ in range(int(rng.integers(1, cfg.max_audio + 1))):
            rows = int(rng.integers(lo, hi + 1))  # frames // 2 encoder rows
            if len(ids) + rows + 2 + cfg.text_tokens[0] > budget:
                break
            ids += [sp.boi] + [sp.audio] * rows + [sp.eoi]
            clips.append(synthetic_clip(rng, self.shape.audio_mels, 2 * rows))
            n_text = int(rng.integers(cfg.text_tokens[0], cfg.text_tokens[1] + 1))
            ids += self._text(rng, min(n_text, budget - len(ids)))
        return clips

    def _text(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out.extend((_WORDS[rng.integers(len(_WORDS))] + " ").encode())
        return out[:n]

    def sample(self, step: int, index: int) -> PackedSample:
        """One sequence of one or more documents, each closed by ``eod``: an input image with its
        text closes its document with probability 1/2; the generation queries end the last one."""
        cfg, sh, sp = self.cfg, self.shape, self.special
        rng = np.random.default_rng(self.split.seed(self.seed, step, index))
        n_gen = int(rng.integers(cfg.gen_images[0], cfg.gen_images[1] + 1))
        shapes = sh.gens
        # Which generator each target is for (drawn only when there is a choice: one generator's stream is unchanged).
        which = [int(rng.integers(len(shapes))) if len(shapes) > 1 else 0 for _ in range(n_gen)]
        budget = cfg.seq_len - sum(shapes[k].query_tokens + 2 for k in which) - 1  # the last document's eod
        ids: list[int] = []
        images: list[torch.Tensor] = []
        doc_lens: list[int] = []

        def close() -> None:
            ids.append(sp.eod)
            doc_lens.append(len(ids) - sum(doc_lens))

        for _ in range(int(rng.integers(1, cfg.max_images + 1)) if cfg.max_images else 0):
            side_h, side_w = (int(rng.choice(cfg.image_sizes)) for _ in range(2))
            patches = (side_h // sh.patch_size) * (side_w // sh.patch_size)
            if len(ids) + patches + 2 + cfg.text_tokens[0] > budget:
                break
            ids += [sp.boi] + [sp.image] * patches + [sp.eoi]
            images.append(smooth_image(rng, 3, side_h, side_w))
            n_text = int(rng.integers(cfg.text_tokens[0], cfg.text_tokens[1] + 1))
            ids += self._text(rng, min(n_text, budget - len(ids)))
            if rng.random() < 0.5 and len(ids) < budget:
                close()
        if cfg.max_images == 0:  # a model without an image encoder: text (and generation) only
            n_text = max(0, min(int(rng.integers(cfg.text_tokens[0], cfg.text_tokens[1] + 1)), budget - 1))
            cut = int(rng.integers(1, n_text)) if n_text > 1 and rng.random() < 0.5 else n_text
            ids += self._text(rng, cut)
            if cut < n_text:  # two documents
                close()
                ids += self._text(rng, n_text - cut)
        clips = self._clips(rng, ids, budget) if self._audio() else []
        for k in which:
            ids += [sp.boi] + [sp.query(k)] * shapes[k].query_tokens + [sp.eoi]
        if len(ids) > sum(doc_lens) or not doc_lens:
            close()
        ids += [sp.pad] * (cfg.seq_len - len(ids))
        t = torch.tensor(ids, dtype=torch.long)
        per_gen: list[list[torch.Tensor]] = [[] for _ in shapes]
        for k in which:
            g = shapes[k]
            per_gen[k].append(smooth_image(rng, g.channels, g.resolution, g.resolution))
        targets = [torch.stack(ts) if ts else torch.zeros(0, g.channels, g.resolution, g.resolution)
                   for ts, g in zip(per_gen, shapes)]
        sample_id = self.split.sample_id(step * self.batch + index)
        return PackedSample(t, labels_for(t, sp, doc_lens), images, targets, sample_id, tuple(doc_lens), audio=clips)

    def global_batch(self, step: int) -> list[PackedSample]:
        return [self.sample(step, i) for i in range(self.batch)]

    def units(self) -> list[list[int]]:
        return [[i] for i in range(self.batch)]  # every sample is drawn from its own seed

    def read_units(self, step: int, units: list[int]) -> dict[int, PackedSample]:
        return {i: self.sample(step, i) for i in units}

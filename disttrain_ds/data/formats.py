"""Record formats -> documents: tokenised text and sized images, in sequence order.

Which images are generated (the generator must produce them from the LLM's query states) and
which are read (the encoder sees them):

* caption pairs (LAION, local ``image``+``caption``): with probability ``data.gen_prob`` the pair is
  text-to-image (caption, then the generated image); otherwise image-to-text (image, then caption).
  A local record may force the choice with ``"generate": true|false``, or name the generator that
  produces the image (``"generate": "sketcher"``, a module name; true is the first generator).
* interleaved documents (MMC4, local ``segments``): the last image of the document is generated;
  the others are read. An input image goes before its matched sentence (as MMC4 readers do); the
  generated image goes right after its matched sentence, so that sentence conditions it. A local
  document that marks any image with ``generate`` uses those marks instead (a mark may name the
  generator, as in pairs).

Without a name, a generated image is the first generator's (graph order). A name the model has no
generator for skips the record (``unknown_generator``): records are parsed lazily, as training
reads them, so a data set made for another model shows in the skip counts (and, when no record
is usable, in the no-usable-records error that lists them) rather than stopping a run midway.
Nothing is generated when ``data.gen_images`` allows 0 images per sequence. A record that cannot
be used becomes a ``Bad(reason)``; the reasons are the keys of ``skip_counts()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Union

import numpy as np

from disttrain_ds.data.audio import clip_frames
from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.images import ImageRef, check_file
from disttrain_ds.data.reader import RawRecord
from disttrain_ds.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextSeg:
    """A run of text tokens."""

    ids: tuple[int, ...]
    """Token ids."""


@dataclass(frozen=True)
class ImageSeg:
    """One image, either read by the encoder or produced by the generator."""

    ref: ImageRef
    """Where its pixels come from."""
    height: int
    """Input height in pixels (multiple of the patch size); unused when generated."""
    width: int
    """Input width in pixels (multiple of the patch size); unused when generated."""
    generate: bool
    """True: a generation target (query tokens in the sequence); False: an encoder input."""
    gen: int = 0
    """Generated images: the generator (graph order) that produces it, whose query token, query
    count and resolution it takes."""


@dataclass(frozen=True)
class AudioSeg:
    """One input audio clip, read by the audio encoder."""

    path: str
    """Resolved .wav or .npy file (``kind`` file), or a ``blobs`` key of the clip's bytes inside a
    shard (``kind`` blob)."""
    frames: int
    """Log-mel frames the clip gives (even, at most the encoder's ``max_frames``); ``frames // 2``
    audio placeholders in the sequence."""
    kind: str = "file"
    """file | blob: where ``path`` points."""


Segment = Union[TextSeg, ImageSeg, AudioSeg]


@dataclass(frozen=True)
class Document:
    """A parsed record."""

    segments: tuple[Segment, ...]
    """Text and images in sequence order."""
    splittable: bool
    """Interleaved documents may continue in the next sequence; caption pairs never split."""


@dataclass(frozen=True)
class Bad:
    """A record that was skipped."""

    reason: str
    """missing_image | corrupt_image | image_too_large | empty_text | too_long | too_many_images |
    not_utf8 | bad_json | bad_type | bad_image | bad_audio | missing_audio | no_audio_encoder |
    too_many_clips | unknown_generator."""


@dataclass(frozen=True)
class ParseContext:
    """Everything parsing needs besides the record."""

    cfg: DataConfig
    """Data settings (image sizes, sampler, gen_prob, limits)."""
    tokenizer: Tokenizer
    """Text to ids."""
    patch_size: int
    """Encoder patch side."""
    gen_queries: tuple[int, ...]
    """Generation-query tokens per image of each generator, in graph order."""
    seed: int
    """Run seed (image sizes and generation choices are drawn from it)."""
    audio_mels: int = 0
    """Log-mel bins of the audio encoder's input; 0: the model has no audio encoder."""
    audio_max_frames: int = 0
    """Longest clip the audio encoder reads, in log-mel frames (longer clips are cut)."""
    generators: tuple[str, ...] = ()
    """Module names of the generators, in graph order (records name a target's generator by
    them); empty: only the first generator, unnamed."""
    bos: int = -1
    """The tokenizer's begin-of-text id, put before every document (``SpecialTokens.bos``); -1: none."""

    def queries(self, gen: int) -> int:
        """Query tokens per image of generator ``gen`` (graph order)."""
        return self.gen_queries[gen]


class _BadRecord(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def _draw_size(rng: np.random.Generator, cfg: DataConfig) -> tuple[int, int]:
    h = int(rng.choice(cfg.image_sizes))
    w = h if cfg.resolution_sampler == "square" else int(rng.choice(cfg.image_sizes))
    return h, w


def _text(ctx: ParseContext, value: object, first: bool) -> TextSeg | None:
    if not isinstance(value, str):
        raise _BadRecord("bad_type")
    value = value.strip()
    if not value:
        return None
    try:
        ids = ctx.tokenizer.encode(value if first else " " + value)
    except UnicodeError:  # lone surrogates from JSON escapes
        raise _BadRecord("not_utf8") from None
    return TextSeg(tuple(ids)) if ids else None


def _image(ctx: ParseContext, rng: np.random.Generator, ref: ImageRef, generate: bool, gen: int = 0) -> ImageSeg:
    if ref.kind == "file":
        reason = check_file(ref.key, ref.max_pixels)
        if reason:
            raise _BadRecord(reason)
    h, w = _draw_size(rng, ctx.cfg)
    return ImageSeg(ref, h, w, generate, gen if generate else 0)


def is_mark(value: object) -> bool:
    """A valid ``generate`` value: absent, true / false, or a generator's name."""
    return value is None or isinstance(value, (bool, str))


def generator_of(ctx: ParseContext, mark: object) -> int | None:
    """The generator a ``generate`` mark asks for (graph order), None for false: true is the first
    generator, a string names one (``unknown_generator`` when the model has none by that name)."""
    if mark is False:
        return None
    if mark is True:
        return 0
    if not isinstance(mark, str):
        raise _BadRecord("bad_type")
    if mark not in ctx.generators:
        raise _BadRecord("unknown_generator")
    return ctx.generators.index(mark)


def _url(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord("bad_image")
    return value.strip()


def _file_ref(value: object, base: Path, ctx: ParseContext) -> ImageRef:
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord("bad_image")
    try:
        return ImageRef("file", str((base / value).resolve()), ctx.cfg.max_image_pixels)
    except (ValueError, OSError, RuntimeError):  # NUL byte, lone surrogate, name too long, symlink loop
        raise _BadRecord("bad_image") from None


def _audio(ctx: ParseContext, value: object, base: Path) -> AudioSeg:
    if ctx.audio_mels == 0:
        raise _BadRecord("no_audio_encoder")
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord("bad_audio")
    try:
        path = (base / value).resolve()
        frames = clip_frames(path, ctx.audio_mels, ctx.audio_max_frames)
    except (ValueError, OSError, RuntimeError, EOFError):
        raise _BadRecord("bad_audio") from None
    return AudioSeg(str(path), frames)


def _generating(ctx: ParseContext) -> bool:
    return ctx.cfg.gen_images[1] > 0


def parse_mmc4(obj: dict, rec: RawRecord, ctx: ParseContext, rng: np.random.Generator) -> Document:
    """MMC4: ``text_list`` sentences, ``image_info`` entries with ``raw_url`` and ``matched_text_index``."""
    sentences, infos = obj.get("text_list"), obj.get("image_info", [])
    if not isinstance(sentences, list) or not isinstance(infos, list):
        raise _BadRecord("bad_type")
    placed: list[tuple[int, str]] = []
    for info in infos:
        if not isinstance(info, dict):
            raise _BadRecord("bad_type")
        index = info.get("matched_text_index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(sentences):
            raise _BadRecord("bad_type")
        placed.append((index, _url(info.get("raw_url"))))
    placed.sort(key=lambda p: p[0])  # stable: ties keep image_info order
    gen_at = len(placed) - 1 if placed and _generating(ctx) else -1
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}
    for j, (index, _) in enumerate(placed):
        (after if j == gen_at else before).setdefault(index, []).append(j)
    segs: list[Segment] = []
    for i, sentence in enumerate(sentences):
        for j in before.get(i, []):
            segs.append(_image(ctx, rng, ImageRef("photo", placed[j][1]), False))
        text = _text(ctx, sentence, first=not any(isinstance(s, TextSeg) for s in segs))
        if text:
            segs.append(text)
        for j in after.get(i, []):
            segs.append(_image(ctx, rng, ImageRef("photo", placed[j][1]), True))
    return Document(tuple(segs), splittable=True)


def _pair(ctx: ParseContext, rng: np.random.Generator, ref: ImageRef, caption: object, generate: object) -> Document:
    text = _text(ctx, caption, first=True)
    if text is None:
        raise _BadRecord("empty_text")
    draw = rng.random() < ctx.cfg.gen_prob  # drawn even when forced, so later draws do not shift
    gen = generator_of(ctx, draw if generate is None else generate)
    generate = gen is not None and _generating(ctx)
    image = _image(ctx, rng, ref, generate, gen or 0)
    return Document((text, image) if generate else (image, text), splittable=False)


def parse_laion(obj: dict, rec: RawRecord, ctx: ParseContext, rng: np.random.Generator) -> Document:
    """LAION caption pair: ``caption`` and, if present, ``url`` (else the record position names the image)."""
    url = obj.get("url")
    key = _url(url) if url is not None else f"laion:{rec.file.name}:{rec.line}"
    return _pair(ctx, rng, ImageRef("photo", key), obj.get("caption"), None)


def parse_local(obj: dict, rec: RawRecord, ctx: ParseContext, rng: np.random.Generator) -> Document:
    """Local records: an interleaved ``segments`` document or an ``image`` + ``caption`` pair (docs/data.md)."""
    base = rec.file.parent
    if "segments" in obj:
        items = obj["segments"]
        if not isinstance(items, list):
            raise _BadRecord("bad_type")
        # Parquet structs carry every field, unset ones as null: keep only the set ones.
        items = [{k: v for k, v in it.items() if v is not None} if isinstance(it, dict) else it for it in items]
        marks = [it.get("generate") for it in items if isinstance(it, dict) and "image" in it]
        if not all(is_mark(m) for m in marks):
            raise _BadRecord("bad_type")
        explicit = any(m is not None for m in marks)
        n_images, seen = len(marks), 0
        segs: list[Segment] = []
        for it in items:
            if not isinstance(it, dict) or len({"text", "image", "audio"} & it.keys()) != 1:
                raise _BadRecord("bad_type")
            if "audio" in it:
                segs.append(_audio(ctx, it["audio"], base))
                continue
            if "text" in it:
                text = _text(ctx, it["text"], first=not any(isinstance(s, TextSeg) for s in segs))
                if text:
                    segs.append(text)
                continue
            gen = generator_of(ctx, it.get("generate", False) if explicit else seen == n_images - 1)
            segs.append(_image(ctx, rng, _file_ref(it["image"], base, ctx), gen is not None and _generating(ctx), gen or 0))
            seen += 1
        return Document(tuple(segs), splittable=True)
    if "image" in obj and "caption" in obj:
        return _pair(ctx, rng, _file_ref(obj["image"], base, ctx), obj["caption"], obj.get("generate"))
    raise _BadRecord("bad_type")


PARSERS: dict[str, Callable[[dict, RawRecord, ParseContext, np.random.Generator], Document]] = {
    "mmc4": parse_mmc4,
    "laion": parse_laion,
    "local": parse_local,
}


def seg_cost(seg: Segment, ctx: ParseContext) -> int:
    """Tokens a whole segment takes: text ids, or markers plus placeholders / queries."""
    if isinstance(seg, TextSeg):
        return len(seg.ids)
    if isinstance(seg, AudioSeg):
        return seg.frames // 2 + 2
    if seg.generate:
        return ctx.queries(seg.gen) + 2
    return (seg.height // ctx.patch_size) * (seg.width // ctx.patch_size) + 2


def _check_fits(doc: Document, ctx: ParseContext) -> None:
    """Every document must fit an empty sequence piece by piece (with its end-of-document token)."""
    cfg = ctx.cfg
    if not any(isinstance(s, TextSeg) for s in doc.segments):
        raise _BadRecord("empty_text")
    images = [s for s in doc.segments if isinstance(s, ImageSeg)]
    clips = [s for s in doc.segments if isinstance(s, AudioSeg)]
    if doc.splittable:
        if any(seg_cost(s, ctx) + 1 > cfg.seq_len for s in (*images, *clips)):
            raise _BadRecord("too_long")
        if clips and cfg.max_audio < 1:
            raise _BadRecord("too_many_clips")
        if cfg.max_images < 1 and any(not s.generate for s in images):
            raise _BadRecord("too_many_images")
        return
    if sum(seg_cost(s, ctx) for s in doc.segments) + 1 > cfg.seq_len:
        raise _BadRecord("too_long")
    if sum(not s.generate for s in images) > cfg.max_images or sum(s.generate for s in images) > cfg.gen_images[1]:
        raise _BadRecord("too_many_images")
    if len(clips) > cfg.max_audio:
        raise _BadRecord("too_many_clips")


_BOM = b"\xef\xbb\xbf"
"""UTF-8 byte-order mark."""


def parse_record(fmt: str, rec: RawRecord, ctx: ParseContext, rng: np.random.Generator) -> Document | Bad:
    """Decode, validate and tokenise one raw record; never raises for bad data."""
    try:
        text = rec.raw.removeprefix(_BOM).decode("utf-8")  # editors may start each file (or line) with one
    except UnicodeDecodeError:
        return Bad("not_utf8")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return Bad("bad_json")
    if not isinstance(obj, dict):
        return Bad("bad_type")
    try:
        doc = PARSERS[fmt](obj, rec, ctx, rng)
        if ctx.bos >= 0:  # as the tokenizer itself begins a text; counted in the length check below
            doc = replace(doc, segments=(TextSeg((ctx.bos,)), *doc.segments))
        _check_fits(doc, ctx)
    except _BadRecord as bad:
        return Bad(bad.reason)
    return doc

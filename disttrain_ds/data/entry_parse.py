"""Records of the shard formats (webdataset, parquet, folder, hf) -> documents.

The field names come from ``data.fields``. A record is a caption pair when it has a caption and an
image field (or, in a model with an audio encoder, an audio field: a captioned clip, read before
the caption and the image), an interleaved document when it has the ``texts`` list (with
``images``, and ``audios`` in a model with an audio encoder, aligned to it). Which images are
generated follows ``formats.py``: a pair is text-to-image with probability ``data.gen_prob`` (or as
its ``generate`` field says); in a document the last image is generated (or those its ``generate``
list marks). Images and clips are checked from their header only (size limit, truncation, sample
rate, array shape) and never decoded here. A model without an audio encoder never looks at the
audio fields. Extra skip reasons of these formats:

* ``missing_fields``: neither a caption + image (or audio) pair nor a ``texts`` list;
* ``missing_caption`` / ``missing_image``: a pair's caption, or its image, is absent (or a
  document's image entry names no member of the key);
* ``missing_audio``: in a model with an audio encoder, a caption with neither image nor clip, or a
  document's clip entry naming no member of the key;
* ``bad_audio``: a clip that is not a 16 kHz PCM .wav or an ``[n_mels, frames]`` .npy array.
"""

from __future__ import annotations

import json

import numpy as np

from . import blobs
from .fields import FieldsConfig, first, lookup
from .formats import (AudioSeg, Bad, Document, ParseContext, Segment, TextSeg, _BadRecord, _check_fits, _generating, _image,
                      _pair, _text)
from .images import ImageRef, check_file
from .tables import BlobAt


def _as_text(value: object) -> object:
    """Member bytes as text (``not_utf8`` if they are not UTF-8); other values unchanged."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).removeprefix(b"\xef\xbb\xbf").decode("utf-8")
        except UnicodeDecodeError:
            raise _BadRecord("not_utf8") from None
    return value


def _ref(value: object, record: dict, ctx: ParseContext) -> ImageRef:
    """A checked image reference for a field value (``BlobAt``, or a member name in this key)."""
    if isinstance(value, str) and isinstance(record.get(value.lower()), BlobAt):
        value = record[value.lower()]
    if not isinstance(value, BlobAt):
        raise _BadRecord("missing_image" if isinstance(value, str) or value is None else "bad_image")
    limit = ctx.cfg.max_image_pixels
    if value.kind == "file":
        reason = check_file(value.key, limit)
    else:
        reason = blobs.check_key(value.key, limit)
    if reason:
        raise _BadRecord(reason)
    return ImageRef(value.kind, value.key, limit)


def _clip(value: object, record: dict, ctx: ParseContext) -> AudioSeg:
    """A checked audio clip for a field value (``BlobAt``, or a member name in this key), from its
    header: frames at the encoder's ``max_frames``, even."""
    from .audio import clip_frames, clip_frames_bytes

    if isinstance(value, str) and isinstance(record.get(value.lower()), BlobAt):
        value = record[value.lower()]
    if not isinstance(value, BlobAt):
        raise _BadRecord("missing_audio" if isinstance(value, str) or value is None else "bad_audio")
    try:
        if value.kind == "file":
            frames = clip_frames(value.key, ctx.audio_mels, ctx.audio_max_frames)
        else:
            frames = clip_frames_bytes(blobs.head(value.key), ctx.audio_mels, ctx.audio_max_frames, value.key)
    except (OSError, ValueError, EOFError):
        raise _BadRecord("bad_audio") from None
    return AudioSeg(value.key, frames, value.kind)


def _aligned(record: dict, name: str, n: int, used: bool) -> list:
    """The list field ``name`` aligned with ``n`` texts (all ``None`` when absent or not ``used``)."""
    values = lookup(record, name) if used else None
    values = [None] * n if values is None else values
    if not isinstance(values, list) or len(values) != n:
        raise _BadRecord("bad_type")
    return values


def _document(record: dict, texts: object, fields: FieldsConfig, ctx: ParseContext, rng: np.random.Generator) -> Document:
    if not isinstance(texts, list):
        raise _BadRecord("bad_type")
    images = _aligned(record, fields.images, len(texts), True)
    clips = _aligned(record, fields.audios, len(texts), ctx.audio_mels > 0)
    marks = lookup(record, fields.generate)
    n_images = sum(im is not None for im in images)
    if marks is not None and (not isinstance(marks, list) or len(marks) != len(images)
                              or any(m is not None and not isinstance(m, bool) for m in marks)):
        raise _BadRecord("bad_type")
    segs: list[Segment] = []
    seen = 0
    for i, (text, image, clip) in enumerate(zip(texts, images, clips)):
        if text is not None:
            seg = _text(ctx, _as_text(text), first=not any(isinstance(s, TextSeg) for s in segs))
            if seg:
                segs.append(seg)
        if image is not None:
            generate = bool(marks[i]) if marks is not None else seen == n_images - 1
            segs.append(_image(ctx, rng, _ref(image, record, ctx), generate and _generating(ctx)))
            seen += 1
        if clip is not None:
            segs.append(_clip(clip, record, ctx))
    return Document(tuple(segs), splittable=True)


def _captioned(record: dict, fields: FieldsConfig, ctx: ParseContext, rng: np.random.Generator) -> Document:
    """A caption with an image and/or (models with an audio encoder) a clip; the clip comes first."""
    caption, image = first(record, fields.caption), first(record, fields.image)
    audio = first(record, fields.audio) if ctx.audio_mels > 0 else None
    if caption is None and image is None and audio is None:
        raise _BadRecord("missing_fields")
    if caption is None:
        raise _BadRecord("missing_caption")
    if image is None and audio is None:
        raise _BadRecord("missing_audio" if ctx.audio_mels > 0 else "missing_image")
    clip = (_clip(audio[1], record, ctx),) if audio is not None else ()
    if image is None:
        text = _text(ctx, _as_text(caption[1]), first=True)
        if text is None:
            raise _BadRecord("empty_text")
        return Document((*clip, text), splittable=False)
    pair = _pair(ctx, rng, _ref(image[1], record, ctx), _as_text(caption[1]), lookup(record, fields.generate))
    return Document((*clip, *pair.segments), splittable=False)


def parse_entry(record: dict, fields: FieldsConfig, ctx: ParseContext, rng: np.random.Generator) -> Document | Bad:
    """Validate and tokenise one record; never raises for bad data."""
    try:
        if isinstance(record.get("json"), (bytes, bytearray)):
            try:
                record = {**record, "json": json.loads(_as_text(record["json"]))}
            except (ValueError, RecursionError):
                raise _BadRecord("bad_json") from None
        texts = lookup(record, fields.texts)
        doc = _document(record, texts, fields, ctx, rng) if texts is not None else _captioned(record, fields, ctx, rng)
        _check_fits(doc, ctx)
    except _BadRecord as bad:
        return Bad(bad.reason)
    return doc

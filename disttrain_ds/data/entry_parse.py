"""Records of the shard formats (webdataset, parquet, folder, hf) -> documents.

The field names come from ``data.fields``. A record is a caption pair when it has a caption and an
image field, an interleaved document when it has the ``texts`` list (with ``images`` aligned to
it). Which images are generated follows ``formats.py``: a pair is text-to-image with probability
``data.gen_prob`` (or as its ``generate`` field says); in a document the last image is generated
(or those its ``generate`` list marks). Images are checked from their header only (size limit,
truncation) and never decoded here. Extra skip reasons of these formats:

* ``missing_fields``: neither a caption + image pair nor a ``texts`` list;
* ``missing_caption`` / ``missing_image``: a pair's caption, or its image, is absent (or a
  document's image entry names no member of the key).
"""

from __future__ import annotations

import json

import numpy as np

from . import blobs
from .fields import FieldsConfig, first, lookup
from .formats import Bad, Document, ParseContext, Segment, TextSeg, _BadRecord, _check_fits, _generating, _image, _pair, _text
from .images import ImageRef, check_file
from .tables import ImageAt


def _as_text(value: object) -> object:
    """Member bytes as text (``not_utf8`` if they are not UTF-8); other values unchanged."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).removeprefix(b"\xef\xbb\xbf").decode("utf-8")
        except UnicodeDecodeError:
            raise _BadRecord("not_utf8") from None
    return value


def _ref(value: object, record: dict, ctx: ParseContext) -> ImageRef:
    """A checked image reference for a field value (``ImageAt``, or a member name in this key)."""
    if isinstance(value, str) and isinstance(record.get(value.lower()), ImageAt):
        value = record[value.lower()]
    if not isinstance(value, ImageAt):
        raise _BadRecord("missing_image" if isinstance(value, str) or value is None else "bad_image")
    limit = ctx.cfg.max_image_pixels
    if value.kind == "file":
        reason = check_file(value.key, limit)
    else:
        reason = blobs.check_key(value.key, limit)
    if reason:
        raise _BadRecord(reason)
    return ImageRef(value.kind, value.key, limit)


def _document(record: dict, texts: object, fields: FieldsConfig, ctx: ParseContext, rng: np.random.Generator) -> Document:
    images = lookup(record, fields.images)
    images = [None] * len(texts) if images is None and isinstance(texts, list) else images
    marks = lookup(record, fields.generate)
    if not isinstance(texts, list) or not isinstance(images, list) or len(images) != len(texts):
        raise _BadRecord("bad_type")
    n_images = sum(im is not None for im in images)
    if marks is not None and (not isinstance(marks, list) or len(marks) != len(images)
                              or any(m is not None and not isinstance(m, bool) for m in marks)):
        raise _BadRecord("bad_type")
    segs: list[Segment] = []
    seen = 0
    for i, (text, image) in enumerate(zip(texts, images)):
        if text is not None:
            seg = _text(ctx, _as_text(text), first=not any(isinstance(s, TextSeg) for s in segs))
            if seg:
                segs.append(seg)
        if image is not None:
            generate = bool(marks[i]) if marks is not None else seen == n_images - 1
            segs.append(_image(ctx, rng, _ref(image, record, ctx), generate and _generating(ctx)))
            seen += 1
    return Document(tuple(segs), splittable=True)


def parse_entry(record: dict, fields: FieldsConfig, ctx: ParseContext, rng: np.random.Generator) -> Document | Bad:
    """Validate and tokenise one record; never raises for bad data."""
    try:
        if isinstance(record.get("json"), (bytes, bytearray)):
            try:
                record = {**record, "json": json.loads(_as_text(record["json"]))}
            except (ValueError, RecursionError):
                raise _BadRecord("bad_json") from None
        texts = lookup(record, fields.texts)
        if texts is not None:
            doc = _document(record, texts, fields, ctx, rng)
        else:
            caption, image = first(record, fields.caption), first(record, fields.image)
            if caption is None and image is None:
                raise _BadRecord("missing_fields")
            if caption is None:
                raise _BadRecord("missing_caption")
            if image is None:
                raise _BadRecord("missing_image")
            generate = lookup(record, fields.generate)
            doc = _pair(ctx, rng, _ref(image[1], record, ctx), _as_text(caption[1]), generate)
        _check_fits(doc, ctx)
    except _BadRecord as bad:
        return Bad(bad.reason)
    return doc

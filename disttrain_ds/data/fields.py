"""Recipe section ``data.fields``: which fields of a webdataset / parquet / folder / hf record hold what
(captions, images, audio clips, interleaved lists).

A record of these formats is a mapping of field names to values: the members of one key in a tar
shard or a folder (``jpg``, ``txt``, ``json`` ...: the file name after the key's first dot), or the
columns of one parquet / ``datasets`` row. A name is looked up in the record itself, then inside
its ``json`` member (img2dataset writes the caption there too); ``a.b`` reaches into nested objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FieldsConfig:
    """Field names of caption pairs (LAION layout, or a captioned audio clip) and interleaved
    documents (MMC4 / OBELICS layout)."""

    caption: list[str] = field(default_factory=lambda: ["txt", "caption", "text"])
    """Caption pair: the caption's field; the first name a record has is used."""
    image: list[str] = field(default_factory=lambda: ["jpg", "jpeg", "png", "webp", "image"])
    """Caption pair: the image's field (encoded image bytes, a ``{"bytes": ...}`` struct, or in a
    folder the image file); the first name a record has is used."""
    texts: str = "texts"
    """Interleaved document: the list of texts, in reading order, ``null`` where an image stands."""
    images: str = "images"
    """Interleaved document: the list of images aligned with ``texts`` (``null`` where a text
    stands); each entry is image bytes, a ``{"bytes": ...}`` struct, or (tar shards and folders)
    the name of the key's member holding it, e.g. ``"0.jpg"`` for ``<key>.0.jpg``."""
    audio: list[str] = field(default_factory=lambda: ["wav", "audio"])
    """Models with an audio encoder: a record's audio clip (.wav bytes or .npy log-mel bytes, a
    ``{"bytes": ...}`` struct, a tar member, or in a folder the file); the first name a record has
    is used. A record with it and a caption is a captioned clip (with an image too, both are read).
    Models without an audio encoder never look it up."""
    audios: str = "audios"
    """Interleaved document, models with an audio encoder: an optional list aligned with ``texts``
    (``null`` where no clip stands); entries as in ``images`` (bytes, a struct, or the name of the
    key's member holding the clip, e.g. ``"0.wav"``)."""
    generate: str = "generate"
    """Optional boolean: on a pair, forces text-to-image (true) or image-to-text (false); in an
    interleaved record, a list aligned with ``images`` marking the images to generate."""


def expected(fields: FieldsConfig) -> str:
    """One line naming what a usable record holds (for the no-usable-records error)."""
    return (f"expected a caption pair (caption field {' | '.join(fields.caption)} with image field "
            f"{' | '.join(fields.image)} or, with an audio encoder, audio field {' | '.join(fields.audio)}) or an "
            f"interleaved document (lists {fields.texts} + {fields.images} [+ {fields.audios}]); set data.fields to your names")


_MISSING = object()


def lookup(record: dict, name: str) -> object:
    """``record[name]`` (dotted names reach into nested objects), else the same inside ``record["json"]``;
    ``None`` when absent."""
    for root in (record, record.get("json")):
        value: object = root
        for part in name.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
            if value is _MISSING:
                break
        if value is not _MISSING:
            return value
    return None


def first(record: dict, names: list[str]) -> tuple[str, object] | None:
    """``(name, value)`` of the first of ``names`` the record holds (not null), or None."""
    for name in names:
        value = lookup(record, name)
        if value is not None:
            return name, value
    return None

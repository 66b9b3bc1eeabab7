"""Image and audio bytes stored inside shards: where they are (a JSON key) and reading them back.

A document names an image (or an audio clip) held in a tar member, a parquet cell or a ``datasets`` row by a small
key, never by the bytes themselves, so the document cache stays small and a producer process
reads exactly the images and clips of the steps it prepares. Keys (JSON lists):

* ``["tar", path, offset, size]``: a tar member's data (read with ``os.pread``: no shared file
  position, safe after ``fork``);
* ``["pq", path, row_group, row, column, index]``: a parquet cell (``index`` into a list cell, or null);
* ``["hf", path, cache_dir, row, column, index]``: a ``datasets`` row's cell (the dataset opened by ``hf.open``).

A cell holds encoded bytes, or a ``{"bytes": ...}`` struct (the Hugging Face ``Image`` and ``Audio``
layout).
"""

from __future__ import annotations

import io
import json
import warnings

from PIL import Image

from disttrain_ds.data.blob_io import cell_bytes, key, pread, row_group, too_large
from disttrain_ds.data.hf_table import open_dataset

__all__ = ["cell_bytes", "check", "check_key", "head", "key", "pread", "read", "row_group"]

_TAIL = 16
_HEAD = 1 << 16
"""Bytes of a tar member read to check its header at planning (the whole member if that fails)."""


def read(blob_key: str) -> bytes:
    """The stored bytes of a blob; ``OSError`` / ``ValueError`` when they cannot be had."""
    kind, path, *rest = json.loads(blob_key)
    if kind == "tar":
        offset, size = rest
        data = pread(path, offset, size)
        if len(data) != size:
            raise OSError(f"{path}: member at {offset} truncated")
        return data
    if kind == "pq":
        group, row, column, index = rest
        value = row_group(path, group).column(column)[row].as_py()
    elif kind == "hf":
        cache_dir, row, column, index = rest
        value = open_dataset(path, cache_dir)[row][column]
    else:
        raise ValueError(f"unknown blob kind {kind!r}")
    if index is not None:
        value = value[index] if isinstance(value, list) and 0 <= index < len(value) else None
    data = cell_bytes(value)
    if data is None:
        raise ValueError(f"{path}: no bytes at {rest}")
    return data


def head(blob_key: str) -> bytes:
    """The first bytes of a blob, enough for any header (a tar member's first 64 KiB, read in
    place; a cell whole); ``OSError`` / ``ValueError`` when they cannot be had."""
    kind, path, *rest = json.loads(blob_key)
    if kind == "tar":
        offset, size = rest
        return pread(path, offset, min(size, _HEAD))
    return read(blob_key)


def check_key(blob_key: str, max_pixels: int) -> str | None:
    """``check`` for the blob at ``blob_key``; a tar member is checked from its first 64 KiB and
    last bytes (planning reads every record's header, so it must not read every image whole)."""
    try:
        kind, path, *rest = json.loads(blob_key)
        if kind == "tar" and rest[1] > _HEAD + _TAIL:
            offset, size = rest
            head, tail = pread(path, offset, _HEAD), pread(path, offset + size - _TAIL, _TAIL)
            if len(head) == _HEAD and len(tail) == _TAIL:
                reason = check(head, max_pixels, tail)
                if reason != "corrupt_image":  # a header past the first 64 KiB: look at the whole member
                    return reason
        return check(read(blob_key), max_pixels)
    except (OSError, ValueError):
        return "corrupt_image"


def check(data: bytes, max_pixels: int, tail: bytes | None = None) -> str | None:
    """Why encoded image bytes are unusable (``corrupt_image`` | ``image_too_large``), or None.

    Only the header is parsed: a decompression bomb is refused by its declared size, never decoded.
    ``tail``: the last bytes when ``data`` is only the start of the image.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                fmt, (w, h) = img.format, img.size
    except Image.DecompressionBombError:
        return "image_too_large"
    except Exception:  # noqa: BLE001 - any header failure means the bytes are not an image
        return "corrupt_image"
    tail = data[-_TAIL:] if tail is None else tail
    if w < 1 or h < 1 or (fmt == "JPEG" and b"\xff\xd9" not in tail) or (fmt == "PNG" and b"IEND" not in tail):
        return "corrupt_image"
    return "image_too_large" if too_large((w, h), max_pixels) else None

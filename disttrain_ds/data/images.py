"""Image pixels: decode, crop, resize and normalise to float [-1, 1] CHW tensors.

Records name images either by URL (MMC4 and LAION metadata carry no pixels) or by file path
(local data). A URL is given the pixels of one of the real photographs shipped with
scikit-image, picked and cropped by a hash of the URL, so the same URL always gives the same
picture. Those photographs are kept JPEG-encoded in memory and decoded for every use, so the
preprocessing cost (decode + resize) is that of a real image pipeline.
"""

from __future__ import annotations

import functools
import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from disttrain_ds.data.blob_io import too_large
from disttrain_ds.data.blobs import read

PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "camera", "coins", "moon",
    "hubble_deep_field", "immunohistochemistry", "grass", "gravel", "brick", "cell",
)
"""scikit-image photographs that ship inside the wheel (no download)."""


@dataclass(frozen=True)
class ImageRef:
    """Where an image's pixels come from."""

    kind: str
    """photo (a URL mapped onto a shipped photograph) | file (a local image file) | blob (bytes
    inside a shard: a tar member, a parquet or ``datasets`` cell; ``key`` as in ``blobs.py``)."""
    key: str
    """The URL or the absolute file path."""
    max_pixels: int = 0
    """Files: largest width x height decoded (checked on the header first); 0: PIL's own limit only."""


class ImageDecodeError(ValueError):
    """An image file exists but cannot be decoded."""


def stable_hash(key: str) -> int:
    """64-bit hash that is the same in every process and Python version (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=None)
def _photo_jpeg(name: str) -> bytes:
    import skimage.data

    arr = np.asarray(getattr(skimage.data, name)())
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    img = Image.fromarray(arr).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _photo(key: str) -> Image.Image:
    """The shipped photograph for ``key``, decoded, with a hash-chosen crop (60-100% per side)."""
    h = stable_hash(key)
    img = Image.open(io.BytesIO(_photo_jpeg(PHOTOS[h % len(PHOTOS)]))).convert("RGB")
    frac = 0.6 + 0.4 * ((h >> 8) % 1024) / 1023
    cw, ch = max(1, int(img.width * frac)), max(1, int(img.height * frac))
    x0 = (h >> 20) % (img.width - cw + 1)
    y0 = (h >> 36) % (img.height - ch + 1)
    return img.crop((x0, y0, x0 + cw, y0 + ch))


def _open(path: str | Path) -> Image.Image:
    """``Image.open`` without PIL's size warning: ``data.max_image_pixels`` is the limit that applies."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(path)


def _file(path: "str | io.BytesIO", max_pixels: int = 0) -> Image.Image:
    try:
        with _open(path) as img:
            if too_large(img.size, max_pixels):  # the header only: nothing decoded yet
                raise ValueError(f"{img.size[0]} x {img.size[1]} pixels, more than {max_pixels}")
            if img.mode.startswith("I;16"):  # 16-bit grey: convert() would clip it to white; keep the top 8 bits
                return Image.fromarray((np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8)).convert("RGB")
            return img.convert("RGB")  # convert() forces the full decode inside the try
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad files
        raise ImageDecodeError(f"{path}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc


def _center_square(img: Image.Image) -> Image.Image:
    side = min(img.width, img.height)
    x0, y0 = (img.width - side) // 2, (img.height - side) // 2
    return img.crop((x0, y0, x0 + side, y0 + side))


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 [3, H, W] in [-1, 1]."""
    arr = np.asarray(img, dtype=np.float32)
    return torch.from_numpy(arr.transpose(2, 0, 1).copy()).div_(127.5).sub_(1.0)


def load_image(ref: ImageRef, height: int, width: int, square_crop: bool = False) -> torch.Tensor:
    """Decode ``ref`` and resize it to ``height`` x ``width`` (centre-square crop first if asked)."""
    if ref.kind == "photo":
        img = _photo(ref.key)
    elif ref.kind == "blob":
        img = _file(io.BytesIO(read(ref.key)), ref.max_pixels)
    else:
        img = _file(ref.key, ref.max_pixels)
    if square_crop:
        img = _center_square(img)
    return to_tensor(img.resize((width, height), Image.Resampling.BICUBIC))


def _tail_ok(path: Path, fmt: str | None) -> bool:
    """Cheap truncation check: JPEG ends with EOI, PNG with its IEND chunk."""
    if fmt not in ("JPEG", "PNG"):
        return True
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 16))
        tail = f.read()
    return b"\xff\xd9" in tail if fmt == "JPEG" else b"IEND" in tail


@functools.lru_cache(maxsize=65536)
def check_file(path: str, max_pixels: int = 0) -> str | None:
    """Why an image file is unusable (``missing_image`` | ``corrupt_image`` | ``image_too_large``), or None.

    Reads the header and the last bytes only, so planning stays cheap and a decompression bomb is
    never decoded: over ``max_pixels`` (0: no limit of ours), or over PIL's own limit, it is
    ``image_too_large``. A file that passes and still fails to decode later is replaced by a grey
    image and counted as ``image_decode_failed``.
    """
    p = Path(path)
    try:
        if not p.is_file():
            return "missing_image"
    except (OSError, ValueError):  # e.g. a name too long for the filesystem: no such file can exist
        return "missing_image"
    try:
        with _open(p) as img:
            fmt, (w, h) = img.format, img.size
    except Image.DecompressionBombError:  # a header over twice PIL's MAX_IMAGE_PIXELS
        return "image_too_large"
    except Exception:  # noqa: BLE001 - any header failure means the file is not an image
        return "corrupt_image"
    if w < 1 or h < 1 or not _tail_ok(p, fmt):
        return "corrupt_image"
    return "image_too_large" if too_large((w, h), max_pixels) else None

"""What a pixel is: the types kept, their ranges, the two kinds of image, and resampling.

Why images are kept as they are: a 16-bit fluorescence scan squeezed into
8-bit RGB loses the dynamic range it was taken for, and a 40-channel
multiplex image squeezed into three channels loses most of its markers. So
every reader returns the source's own pixel type (``uint8``, ``uint16`` or
``float32``) and channel count, the store keeps them, and only the loader
turns pixels into float tensors (:mod:`hyfi_imaging.data.normalize`).

Two kinds of image, told apart by their channels (:func:`is_rgb`):

* **RGB** (bright-field: H&E, IHC): three channels named ``red, green, blue``
  (OpenSlide, RGB TIFFs, PNG/JPEG). Glass is white: the background is the
  type's maximum (255 for uint8), tissue is darker and more saturated.
* **Intensity** images (fluorescence, multiplex, grayscale, scientific): any
  other channels. The background is 0 (dark) and tissue is where the signal
  is (:func:`hyfi_imaging.preprocess.tissue.tissue_mask`).

Resampling goes through Pillow one channel at a time: uint8 as 8-bit images
(exactly what hyfi-imaging always did), other types as 32-bit float images,
rounded back to the integer type (:func:`cast_to`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

__all__ = [
    "PALETTE",
    "RGB_COLORS",
    "RGB_NAMES",
    "SUPPORTED_DTYPES",
    "cast_to",
    "default_background",
    "default_channels",
    "dtype_range",
    "is_rgb",
    "resize_channels",
    "rgb_equivalent_side",
    "supported_dtype",
]

#: Pixel types hyfi-imaging reads, stores and trains on, unchanged.
SUPPORTED_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.float32))
#: Channel names of an RGB (bright-field) image.
RGB_NAMES = ("red", "green", "blue")
#: Their display colours (``RRGGBB``).
RGB_COLORS = ("FF0000", "00FF00", "0000FF")
#: Display colours of intensity channels without their own, in channel order.
PALETTE = ("FF0000", "00FF00", "0000FF", "00FFFF", "FF00FF", "FFFF00", "FFFFFF")


def supported_dtype(dtype: object) -> np.dtype[np.generic] | None:
    """``dtype`` as a numpy dtype when hyfi-imaging keeps it, else ``None``."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        return None
    return dt if dt in SUPPORTED_DTYPES else None


def dtype_range(dtype: np.dtype[np.generic] | type) -> tuple[float, float]:
    """The nominal value range of a pixel type: ``(0, 255)``, ``(0, 65535)``, float ``(0, 1)``."""
    dt = np.dtype(dtype)
    if dt.kind in "ui":
        info = np.iinfo(dt.type)  # type: ignore[type-var]
        return float(info.min), float(info.max)
    return 0.0, 1.0


def is_rgb(names: Sequence[str]) -> bool:
    """True for a bright-field RGB image: its channels are named ``red, green, blue``."""
    return tuple(names) == RGB_NAMES


def default_background(dtype: np.dtype[np.generic] | type, *, rgb: bool) -> float:
    """Fill value outside an image: white glass (the type's maximum) for RGB, else 0 (dark)."""
    hi = dtype_range(dtype)[1]
    if not rgb:
        return 0
    return int(hi) if np.dtype(dtype).kind in "ui" else hi


def default_channels(channels: int, *, rgb: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names and display colours of channels that carry none: RGB's, or ``c0, c1, ...``.

    A single intensity channel is shown white (grey); several take :data:`PALETTE` in order.
    """
    if rgb:
        return RGB_NAMES, RGB_COLORS
    names = tuple(f"c{i}" for i in range(channels))
    if channels == 1:
        return names, ("FFFFFF",)
    return names, tuple(PALETTE[i % len(PALETTE)] for i in range(channels))


def rgb_equivalent_side(side: float, channels: int, itemsize: int) -> float:
    """The side of a square of these pixels that holds no more bytes than an 8-bit RGB ``side``².

    Memory budgets (shards, render tiles) are sized for 8-bit RGB; pixels of
    more bytes (16-bit, many channels) get a proportionally smaller square,
    those of 3 bytes or fewer the same one.
    """
    return side * math.sqrt(3 / max(3, channels * itemsize))


def cast_to(values: np.ndarray, dtype: np.dtype[np.generic]) -> np.ndarray:
    """Float pixel values as ``dtype``: integers rounded (half to even) and clipped to the type."""
    if dtype.kind in "ui":
        lo, hi = dtype_range(dtype)
        return np.clip(np.rint(values), lo, hi).astype(dtype)
    return values.astype(dtype, copy=False)


def resize_channels(
    block: np.ndarray,
    box: tuple[float, float, float, float],
    out_hw: tuple[int, int],
    resample: Image.Resampling,
) -> np.ndarray:
    """Resample the ``box`` ``(x0, y0, x1, y1)`` of a ``(C, h, w)`` block to ``out_hw``, per channel.

    uint8 goes through Pillow's 8-bit images (rounded there); uint16 and
    float32 through its float images, then :func:`cast_to` the block's type.
    """
    h, w = out_hw
    if block.dtype == np.uint8:
        planes = [np.ascontiguousarray(c) for c in block]
    else:
        planes = [np.ascontiguousarray(c, dtype=np.float32) for c in block]
    out = np.stack(
        [np.asarray(Image.fromarray(p).resize((w, h), resample, box=box)) for p in planes]
    )
    return out if block.dtype == np.uint8 else cast_to(out, block.dtype)

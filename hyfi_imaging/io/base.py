"""The one protocol every slide reader implements, plus an in-memory reader.

Why a protocol and not a base class: the readers wrap very different libraries
(OpenSlide, tifffile's zarr view, zarr itself, Pillow) and share no state; what
they share is a vocabulary. Coordinates are ``(y, x)`` and sizes ``(h, w)``
everywhere; ``read_region`` takes coordinates *in the pixels of the level it
reads*. Reads outside the image are filled with :attr:`background` so that a
tile plus halo at the border of an image never needs special cases upstream.

Pixels come as the source has them (:mod:`hyfi_imaging.io.pixels`): ``dtype``
uint8, uint16 or float32, ``channels`` of them, named. Pyramid geometry is per
axis: a level's downsample is ``(dy, dx)`` level-0 pixels per level pixel
(:func:`level_downsample`), because a TIFF pyramid of ``floor(h / 2**k)`` levels
has slightly different ratios along y and x, and one averaged number (OpenSlide's
convention) puts a crop up to a pixel and a half off at the far edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
from PIL import Image

from hyfi_imaging.io.pixels import default_background, default_channels, resize_channels

__all__ = [
    "BACKGROUND",
    "THUMBNAIL_STRIP_BYTES",
    "ArrayReader",
    "Downsample",
    "SlideReader",
    "clip_region",
    "level_downsample",
    "level_for",
    "paste_region",
    "read_filled",
    "thumbnail",
]

#: Level-0 pixels per level pixel along ``(y, x)``.
Downsample = tuple[float, float]

#: Background value of bright-field slides (white glass).
BACKGROUND = 255


@runtime_checkable
class SlideReader(Protocol):
    """What hyfi-imaging needs from an image source.

    Attributes:
        path: the file or store this reader opened.
        format: what the content is, e.g. ``"aperio"``, ``"generic-tiff"``,
            ``"ome-tiff"``, ``"ome-zarr"``, ``"png"``.
        level_dimensions: ``(h, w)`` of every pyramid level, level 0 first.
        level_downsamples: ``(dy, dx)`` level-0 pixels per level pixel, per level
            (see :func:`level_downsample`).
        mpp: microns per level-0 pixel, or ``None`` when the file does not say.
        mpp_source: where ``mpp`` came from: ``"vendor"``, ``"tiff-resolution"``,
            ``"ome"``, ``"override"`` or ``"none"``.
        channels: number of channels ``read_region`` returns (3 for RGB slides).
        dtype: pixel type ``read_region`` returns (uint8, uint16 or float32).
        channel_names: one name per channel (``red, green, blue`` for RGB).
        channel_colors: one display colour ``RRGGBB`` per channel.
        background: fill value used outside the image.
    """

    path: str
    format: str
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[Downsample, ...]
    mpp: float | None
    mpp_source: str
    channels: int
    dtype: np.dtype[np.generic]
    channel_names: tuple[str, ...]
    channel_colors: tuple[str, ...]
    background: float

    @property
    def level_count(self) -> int: ...

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Read ``[y, y+h) x [x, x+w)`` of ``level`` as ``(C, h, w)`` of :attr:`dtype`."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> SlideReader: ...

    def __exit__(self, *exc: object) -> None: ...


def level_downsample(level0_hw: tuple[int, int], level_hw: tuple[int, int]) -> Downsample:
    """``(dy, dx)``: level-0 pixels per pixel of a level of ``level_hw``, per axis.

    Where a level's side is ``floor`` or ``ceil`` of the level-0 side over an
    integer ``f`` (``f = round(n0 / n)``), the level is that exact ``f``-grid:
    pixel ``i`` covers level-0 pixels ``[i·f, (i+1)·f)`` (the remainder at the far
    edge is left out or averaged over what exists), so the downsample is ``f``,
    not ``n0 / n``. Otherwise it is the plain ratio ``n0 / n``. This is the one
    place level coordinates come from.

    >>> level_downsample((1027, 2048), (256, 512))
    (4.0, 4.0)
    >>> level_downsample((1000, 1000), (300, 300))
    (3.3333333333333335, 3.3333333333333335)
    """

    def axis(n0: int, n: int) -> float:
        f = max(1, round(n0 / n))
        return float(f) if n in (n0 // f, -(-n0 // f)) else n0 / n

    return axis(level0_hw[0], level_hw[0]), axis(level0_hw[1], level_hw[1])


def level_for(downsamples: tuple[Downsample, ...], factor: float) -> int:
    """The coarsest level whose downsample along both axes is at most ``factor`` (else 0)."""
    level = 0
    for i, (dy, dx) in enumerate(downsamples):
        if max(dy, dx) <= factor + 1e-6:
            level = i
    return level


def clip_region(
    y: int, x: int, h: int, w: int, height: int, width: int
) -> tuple[int, int, int, int] | None:
    """Intersect a region with ``[0, height) x [0, width)``.

    Returns ``(y0, x0, y1, x1)`` of the intersection in image coordinates, or
    ``None`` when the region lies wholly outside the image.
    """
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + h, height), min(x + w, width)
    if y0 >= y1 or x0 >= x1:
        return None
    return y0, x0, y1, x1


def paste_region(
    inside: np.ndarray, y: int, x: int, h: int, w: int, box: tuple[int, int, int, int], fill: float
) -> np.ndarray:
    """Place ``inside`` (the clipped read of ``box``) into a ``(C, h, w)`` canvas of ``fill``.

    The canvas has ``inside``'s pixel type.
    """
    y0, x0, y1, x1 = box
    if inside.shape[1:] == (h, w):
        return np.ascontiguousarray(inside)
    out = np.full((inside.shape[0], h, w), fill, dtype=inside.dtype)
    out[:, y0 - y : y1 - y, x0 - x : x1 - x] = inside
    return out


class ArrayReader:
    """A single-level reader over an in-memory ``(C, H, W)`` array (uint8, uint16 or float32).

    Used for small images (PNG/JPEG), for tests, and wherever a decoded image
    must be served through the same protocol as a slide. Without names, three
    uint8 channels are RGB (background white); anything else is an intensity
    image (background 0); see :mod:`hyfi_imaging.io.pixels`.
    """

    def __init__(
        self,
        array: np.ndarray,
        *,
        path: str = "<array>",
        format: str = "array",
        mpp: float | None = None,
        mpp_source: str = "none",
        background: float | None = None,
        channel_names: tuple[str, ...] | None = None,
        channel_colors: tuple[str, ...] | None = None,
    ) -> None:
        from hyfi_imaging.io.pixels import SUPPORTED_DTYPES, is_rgb

        if array.ndim != 3 or array.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                "ArrayReader needs a uint8, uint16 or float32 (C, H, W) array, "
                f"got {array.dtype} {array.shape}"
            )
        self.array = array
        self.path = path
        self.format = format
        self.level_dimensions: tuple[tuple[int, int], ...] = (
            (int(array.shape[1]), int(array.shape[2])),
        )
        self.level_downsamples: tuple[Downsample, ...] = ((1.0, 1.0),)
        self.mpp = mpp
        self.mpp_source = mpp_source if mpp is not None else "none"
        self.channels = int(array.shape[0])
        self.dtype: np.dtype[np.generic] = array.dtype
        rgb = self.channels == 3 and array.dtype == np.uint8
        names, colors = default_channels(self.channels, rgb=rgb)
        self.channel_names = channel_names or names
        self.channel_colors = channel_colors or colors
        if background is None:
            background = default_background(array.dtype, rgb=is_rgb(self.channel_names))
        self.background = background

    @property
    def level_count(self) -> int:
        return 1

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        if level != 0:
            raise IndexError(f"{self.path}: level {level} does not exist; this image has 1 level")
        height, width = self.level_dimensions[0]
        box = clip_region(y, x, h, w, height, width)
        if box is None:
            return np.full((self.channels, h, w), self.background, dtype=self.dtype)
        y0, x0, y1, x1 = box
        return paste_region(self.array[:, y0:y1, x0:x1], y, x, h, w, box, self.background)

    def close(self) -> None:
        pass

    def __enter__(self) -> ArrayReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_filled(
    reader: SlideReader,
    level: int,
    y: int,
    x: int,
    h: int,
    w: int,
    fetch: Callable[[int, int, int, int], np.ndarray],
    *,
    fix: str,
    budget: int | None = None,
    decoded: Callable[[tuple[int, int, int, int]], int] | None = None,
) -> np.ndarray:
    """What every ``read_region`` shares: level check, clipping, background fill, one-line errors.

    ``fetch(y0, x0, y1, x1)`` returns the in-image part as ``(C, y1-y0, x1-x0)`` of ``reader.dtype``;
    its failures become :class:`SlideError` with ``fix`` as the advice. With a
    ``budget`` (bytes), a read whose cost is over it is refused before ``fetch``
    decodes anything (:func:`~hyfi_imaging.io.budget.check_read`);
    ``decoded(box)`` is what the reader decodes besides the region to read ``box``.
    """
    from hyfi_imaging.errors import SlideError

    if not 0 <= level < reader.level_count:
        raise IndexError(
            f"{reader.path}: level {level} does not exist; it has {reader.level_count}"
        )
    height, width = reader.level_dimensions[level]
    box = clip_region(y, x, h, w, height, width)
    if budget is not None:
        from hyfi_imaging.io.budget import check_read

        extra = decoded(box) if decoded is not None and box is not None else 0
        check_read(reader, level, h, w, budget, extra)
    if box is None:
        return np.full((reader.channels, h, w), reader.background, dtype=reader.dtype)
    try:
        inside = fetch(*box)
    except SlideError:
        raise
    except Exception as err:
        raise SlideError(
            reader.path,
            f"cannot read level {level} region y={y} x={x} h={h} w={w} ({type(err).__name__}: {err})",
            fix,
        ) from err
    return paste_region(inside, y, x, h, w, box, reader.background)


#: Bytes of source pixels :func:`thumbnail` decodes at once (a strip of rows).
THUMBNAIL_STRIP_BYTES = 64 << 20


def thumbnail(reader: SlideReader, max_size: int) -> tuple[np.ndarray, Downsample]:
    """A ``(C, h, w)`` thumbnail whose longer side is at most ``max_size``, of the reader's type.

    Reads the smallest pyramid level that is still at least as large as the
    thumbnail and area-averages it down. The level is read in strips of rows
    (about ``THUMBNAIL_STRIP_BYTES`` each), because a slide without a pyramid,
    or a 65536² canvas, has no small level: reading it whole would hold
    gigabytes. The box filter never reaches outside a strip's rows, so the
    strips give the pixels of one whole-level resize, up to floating-point
    ties at pixel edges (a level that fits one strip, the usual case, gives
    exactly those pixels). Returns the thumbnail and its ``(dy, dx)``
    downsample relative to level 0 (level-0 pixels per thumbnail pixel, per
    axis: the level's own downsample times the resize's).
    """
    h0, w0 = reader.level_dimensions[0]
    scale = max(h0, w0) / max_size
    level = level_for(reader.level_downsamples, scale)
    lh, lw = reader.level_dimensions[level]
    dy, dx = reader.level_downsamples[level]
    th, tw = max(1, round(h0 / max(scale, 1.0))), max(1, round(w0 / max(scale, 1.0)))
    if (th, tw) == (lh, lw):
        return reader.read_region(level, 0, 0, lh, lw), (dy, dx)
    rows_per_out = lh / th
    row_bytes = reader.channels * lw * reader.dtype.itemsize
    strip_rows = max(1, THUMBNAIL_STRIP_BYTES // max(1, row_bytes))
    step = max(1, math.floor(strip_rows / rows_per_out))
    out = np.empty((reader.channels, th, tw), dtype=reader.dtype)
    for r0 in range(0, th, step):
        r1 = min(th, r0 + step)
        top, bottom = r0 * rows_per_out, min(lh, r1 * rows_per_out)
        y0, y1 = math.floor(top), min(lh, math.ceil(bottom))
        strip = reader.read_region(level, y0, 0, y1 - y0, lw)
        box = (0.0, top - y0, float(lw), bottom - y0)
        out[:, r0:r1] = resize_channels(strip, box, (r1 - r0, tw), Image.Resampling.BOX)
    return out, (lh * dy / th, lw * dx / tw)

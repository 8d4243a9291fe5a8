"""The output canvas of one slide, rendered a region at a time.

Why regions: a 65536² RGB canvas is 12.9 GB, and a worker that builds it in
memory before writing runs the machine out of memory without a warning. The
store writer instead asks :class:`CanvasRenderer` for one shard at a time; the
renderer fills the background and resamples the part of the tissue crop that
falls into the shard, in tiles of at most ``_RENDER_TILE`` output pixels each
read from at most about ``_SOURCE_TILE`` source pixels per side (fewer for
pixels of more than 3 bytes: the read holds no more bytes than an 8-bit RGB
one). Memory is then one shard plus one tile, whatever the canvas size.

Tiles must join without seams: each output pixel's source pixels and weights
are computed from its absolute position alone (:func:`_taps`), and summed in
one order, so a pixel is the same whatever tile renders it (Pillow's resize
of each tile's box rounded its own coefficients and an intermediate image, and
the same pixel came out 1-2 levels apart in two tilings). Box downsampling
never reaches outside its box, so a tile needs no neighbours; bilinear
upsampling reaches one source pixel beyond, so its reads carry a 2-pixel
margin (at the crop's edge that margin is the slide around the crop, or
background outside the slide). A
crop at scale 1 on whole pixels is copied, not resampled, so ``--level N``
output equals the source pixels exactly.

Pixels keep the slide's type and channels (resampled as float32 and rounded
back once, :func:`~hyfi_imaging.io.pixels.cast_to`).
Level coordinates use the level's per-axis downsample ``(dy, dx)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hyfi_imaging.io.base import SlideReader
from hyfi_imaging.io.pixels import cast_to, rgb_equivalent_side

__all__ = [
    "CanvasRenderer",
    "CropPlan",
    "CropTransform",
    "asked_mpp",
    "fit_warning",
    "render_crop",
]

#: Output pixels per side resampled at once.
_RENDER_TILE = 1024
#: Source pixels per side read at once (a strongly reducing resample gets smaller tiles).
_SOURCE_TILE = 4096


@dataclass(frozen=True)
class CropTransform:
    """How source coordinates of one pyramid level map onto the crop's output pixels.

    Output pixel row ``a`` (crop-local) covers source rows
    ``[y0 + a * per_row, y0 + (a + 1) * per_row)`` of the level; columns alike.
    Coordinates are continuous, pixel edges on integers (pixel ``i`` spans
    ``[i, i + 1)``), the convention of ASAP and QuPath annotations too.
    """

    y0: float
    x0: float
    #: the crop's extent on the level (source pixels) and on the output (pixels)
    src_h: float
    src_w: float
    out_h: int
    out_w: int

    @property
    def per_row(self) -> float:
        """Source rows per output row."""
        return self.src_h / self.out_h

    @property
    def per_col(self) -> float:
        """Source columns per output column."""
        return self.src_w / self.out_w

    def to_output(self, y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Level coordinates ``(y, x)`` -> crop-local output coordinates (continuous).

        Multiplied by the output's extent before the division: exact wherever the result is
        representable (an outline's edge on a pixel centre stays on it: through the rounded
        ``per_row`` it came out 449.50000000000006, and a row past the edge was labelled).
        """
        return (y - self.y0) * self.out_h / self.src_h, (x - self.x0) * self.out_w / self.src_w


@dataclass(frozen=True)
class CropPlan:
    """Where the crop comes from and where it goes.

    ``mpp`` is the output's µm/px as it came out; ``fit_scale`` the factor
    ``--fit fit`` shrank the asked resolution by to get the crop onto the
    canvas (1: the resolution asked for; 0.26: a 0.5 µm/px request came out
    at 1.93 µm/px). Recorded, because a slide quietly coarser than its
    cohort trains a model on another magnification.
    """

    source_box: tuple[int, int, int, int]  # y, x, h, w in level-0 source pixels
    placement: tuple[int, int, int, int]  # y, x, h, w in canvas pixels
    read_level: int
    mpp: float | None
    tissue_box: tuple[int, int, int, int]
    fit_scale: float = 1.0

    def transform(self, downsample: tuple[float, float] = (1.0, 1.0)) -> CropTransform:
        """The map from a level of ``downsample`` ``(dy, dx)`` onto the crop's output pixels.

        The one place the crop's arithmetic lives: :func:`render_crop` resamples
        pixels with it (from the read level) and the annotation rasterizer
        (:mod:`hyfi_imaging.preprocess.rasterize`) maps level-0 polygons with
        it, so image and mask cannot drift apart.
        """
        sy, sx, sh, sw = self.source_box
        _, _, ph, pw = self.placement
        dy, dx = downsample
        return CropTransform(sy / dy, sx / dx, sh / dy, sw / dx, ph, pw)

    def to_canvas(self, y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Level-0 source coordinates ``(y, x)`` -> canvas coordinates (continuous)."""
        u, v = self.transform().to_output(y, x)
        return u + self.placement[0], v + self.placement[1]


def asked_mpp(mpp: float | None, fit_scale: float) -> float | None:
    """The µm/px asked for (``--mpp``, or the ``--level``'s) of a slide that came out at ``mpp``."""
    return None if mpp is None else mpp * fit_scale


def fit_warning(mpp: float | None, fit_scale: float, size: tuple[int, int]) -> str | None:
    """The line that says ``--fit fit`` changed a slide's resolution; ``None`` when it did not.

    ``mpp`` is the resolution the slide came out at, ``fit_scale`` the
    :attr:`CropPlan.fit_scale` it was shrunk by, ``size`` the canvas.
    """
    if fit_scale >= 1.0:
        return None
    h, w = size
    if mpp is None:
        said = f"at {1 / fit_scale:.3g}x coarser than asked"
    else:
        said = f"at {mpp:.3g} µm/px instead of the {asked_mpp(mpp, fit_scale):.3g} asked"
    return (
        f"--fit fit shrank the tissue by {fit_scale:.3g} to fit the {h}x{w} canvas: it is {said} "
        "(a larger --size, or --fit crop, keeps the resolution)"
    )


def render_crop(
    reader: SlideReader, plan: CropPlan, window: tuple[int, int, int, int] | None = None
) -> np.ndarray:
    """Resample ``plan.source_box`` to ``plan.placement``'s size; only ``window`` of it.

    ``window`` is ``(r0, c0, r1, c1)`` in crop pixels (default: all of it). The
    window is rendered in tiles of at most ``_RENDER_TILE`` output pixels, each
    from one read of at most about ``_SOURCE_TILE`` source pixels per side, so
    memory does not grow with the crop. Upsampling (bilinear) reads a 2-pixel
    margin so tile edges see their neighbours; downsampling (box) never
    reaches outside its box. A crop at scale 1 on whole pixels is copied as is.
    """
    _, _, ph, pw = plan.placement
    r0, c0, r1, c1 = window if window is not None else (0, 0, ph, pw)
    t = plan.transform(reader.level_downsamples[plan.read_level])
    ly0, lx0, per_row, per_col = t.y0, t.x0, t.per_row, t.per_col
    out = np.empty((reader.channels, r1 - r0, c1 - c0), dtype=reader.dtype)
    if per_row == 1.0 and per_col == 1.0 and ly0.is_integer() and lx0.is_integer():
        return reader.read_region(plan.read_level, int(ly0) + r0, int(lx0) + c0, r1 - r0, c1 - c0)
    downscale = per_col >= 1.0
    margin = 0 if downscale else 2
    source_side = rgb_equivalent_side(_SOURCE_TILE, reader.channels, reader.dtype.itemsize)
    step = max(16, min(_RENDER_TILE, math.floor(source_side / max(per_row, per_col, 1.0))))
    for a0 in range(r0, r1, step):
        a1 = min(r1, a0 + step)
        top, bottom = ly0 + a0 * per_row, ly0 + a1 * per_row
        ya, yb = math.floor(top) - margin, math.ceil(bottom) + margin
        for b0 in range(c0, c1, step):
            b1 = min(c1, b0 + step)
            left, right = lx0 + b0 * per_col, lx0 + b1 * per_col
            xa, xb = math.floor(left) - margin, math.ceil(right) + margin
            block = reader.read_region(plan.read_level, ya, xa, yb - ya, xb - xa)
            rows = _taps(ly0, per_row, a0, a1 - a0, ya, yb - ya, downscale=downscale)
            cols = _taps(lx0, per_col, b0, b1 - b0, xa, xb - xa, downscale=downscale)
            out[:, a0 - r0 : a1 - r0, b0 - c0 : b1 - c0] = _resample(
                block, rows, cols, box=downscale
            )
    return out


def _taps(
    start: float, per: float, first: int, n: int, lo: int, size: int, *, downscale: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Along one axis, the source pixels (indices into a block of ``size`` pixels from
    ``lo``) and weights, ``(n, k)``, of the output pixels ``first .. first + n - 1`` whose
    source interval is ``[start + j per, start + (j + 1) per)``, computed from those
    absolute positions alone: the same for an output pixel whatever tile renders it, so
    tiles join without seams. Reducing (box): the source pixels whose centres lie in the
    interval, equal weights; enlarging (bilinear): the two pixels around the interval's
    centre."""
    j = np.arange(first, first + n, dtype=np.float64)
    if downscale:
        # The n + 1 interval edges, each computed once: an output's run ends where the next
        # one's starts. (Its end taken as ``a + per`` could round apart from the next start
        # ``start + (j + 1) per`` where an edge fell on a pixel centre: a run one pixel short
        # or long, and the sum of one run divided by the other's count -- a column of 120 in
        # a flat 180 image, in about 7 % of width pairs.)
        edges = start + np.arange(first, first + n + 1, dtype=np.float64) * per
        firsts = np.ceil(edges - 0.5).astype(np.int64)  # first centre (i + 1/2) at or after
        i0 = firsts[:-1]
        count = np.maximum(firsts[1:] - i0, 1)
        k = np.arange(int(count.max()))
        idx = i0[:, None] + k
        weights = (k < count[:, None]) / count[:, None]
    else:
        c = start + (j + 0.5) * per - 0.5
        i0 = np.floor(c).astype(np.int64)
        f = c - i0
        idx = np.stack([i0, i0 + 1], 1)
        weights = np.stack([1.0 - f, f], 1)
    return np.clip(idx - lo, 0, size - 1), weights


def _resample(
    block: np.ndarray,
    rows: tuple[np.ndarray, np.ndarray],
    cols: tuple[np.ndarray, np.ndarray],
    *,
    box: bool,
) -> np.ndarray:
    """``block`` ``(C, h, w)`` resampled by the taps of :func:`_taps`, rows then columns,
    in float32, rounded once to the block's type. Each output is computed in one fixed
    order from its taps alone (a box reduction as the sum of its run of source pixels over
    their count, in one pass; bilinear as the weighted sum of its two pixels)."""
    tmp = _along(block, *rows, axis=1, box=box)
    return cast_to(_along(tmp, *cols, axis=2, box=box), block.dtype)


def _along(
    x: np.ndarray, idx: np.ndarray, weights: np.ndarray, *, axis: int, box: bool
) -> np.ndarray:
    """One axis of :func:`_resample`."""
    if box:
        # The box taps of consecutive outputs are consecutive runs (an output with no centre
        # in its interval repeats its neighbour's pixel).
        starts, counts = idx[:, 0], np.count_nonzero(weights, axis=1)
        end = int(starts[-1] + counts[-1])
        part = x[:, int(starts[0]) : end] if axis == 1 else x[:, :, int(starts[0]) : end]
        sums = np.add.reduceat(part, starts - starts[0], axis=axis, dtype=np.float32)
        shape = [1, 1, 1]
        shape[axis] = -1
        return sums / counts.astype(np.float32).reshape(shape)
    out = 0.0
    for i in range(idx.shape[1]):
        w = weights[:, i].astype(np.float32).reshape((-1, 1) if axis == 1 else (1, -1))
        out = out + w * np.take(x, idx[:, i], axis=axis)
    return np.asarray(out, dtype=np.float32)


class CanvasRenderer:
    """The output canvas of one slide, rendered on demand one region at a time.

    A :class:`~hyfi_imaging.io.zarr_store.RegionSource`: the background value
    everywhere except the placement, where :func:`render_crop` puts the
    resampled tissue crop. The store writer asks for one shard at a time, so
    the canvas itself never exists in memory.
    """

    def __init__(self, reader: SlideReader, plan: CropPlan, size: tuple[int, int]) -> None:
        self.reader = reader
        self.plan = plan
        self._shape = (reader.channels, size[0], size[1])
        self.dtype = reader.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._shape

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
        """Canvas pixels ``[y0, y1) x [x0, x1)`` as ``(C, h, w)`` of the slide's type."""
        out = np.full((self._shape[0], y1 - y0, x1 - x0), self.reader.background, self.dtype)
        py, px, ph, pw = self.plan.placement
        iy0, ix0 = max(y0, py), max(x0, px)
        iy1, ix1 = min(y1, py + ph), min(x1, px + pw)
        if iy0 < iy1 and ix0 < ix1:
            out[:, iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0] = render_crop(
                self.reader, self.plan, (iy0 - py, ix0 - px, iy1 - py, ix1 - px)
            )
        return out

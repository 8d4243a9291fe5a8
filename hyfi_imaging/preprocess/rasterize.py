"""Annotation polygons -> a label image on the canvas, one region at a time.

Why our own scanline fill: the mask must land on exactly the pixels the image
has, through the same crop and resampling, at 16384² and beyond, without
holding the mask whole; PIL's ``ImageDraw.polygon`` rounds vertices to whole
pixels and draws outlines inclusively, skimage's ``polygon`` wants the whole
image, and neither states a rule for pixels on the edge.

**The rule.** Pixel ``(i, j)`` is inside a polygon when its centre
``(i + 0.5, j + 0.5)`` (output coordinates) is inside, by the nonzero winding
rule (a freehand outline that loops over itself stays filled; even-odd is
available too). A crossing exactly at a pixel centre counts as left of it
only when strictly left, and an edge counts for the rows whose centre lies in
``[y_low, y_high)``, so polygons that share an edge never both claim a pixel
and a vertex is never counted twice.

**The fill.** For a band of rows, every edge yields the rows it crosses
(``np.repeat``, no rows x edges matrix), the x of each crossing, and a
+1/-1 at the first pixel whose centre lies right of it; a cumulative sum
along the row is the winding number of every pixel. Memory is the band times
the width (plus the crossings), so a 16384-wide mask is filled in bands of
``band`` rows; each polygon is filled only inside its bounding box.

**Labels.** Positive labels are painted in increasing order (a larger value
wins where classes overlap), each polygon minus its own holes; then
exclusions (label 0) clear whatever they cover. Outside the tissue crop's
placement the canvas holds no slide pixels, so the mask is 0 there too.

Polygons come in level-0 coordinates and are moved onto the canvas by
:meth:`~hyfi_imaging.preprocess.canvas.CropPlan.to_canvas`, the transform
the image's resampling uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from hyfi_imaging.io.annotations import LabelledPolygon
from hyfi_imaging.preprocess.canvas import CropPlan

__all__ = ["FillRule", "MaskRenderer", "fill_polygon", "rasterize_labels"]

FillRule = Literal["nonzero", "evenodd"]

#: Rows filled at once: memory is ``band x (width + 1)`` float64 plus the crossings.
DEFAULT_BAND = 256


def _edges(rings: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Non-horizontal edges as ``(y_low, y_high, x at y_low, dx/dy, direction)``."""
    parts = [np.asarray(r, dtype=np.float64).reshape(-1, 2) for r in rings if len(r) >= 2]
    if not parts:
        return tuple(np.empty(0) for _ in range(5))
    a = np.concatenate(parts)
    b = np.concatenate([np.roll(r, -1, axis=0) for r in parts])
    keep = a[:, 0] != b[:, 0]
    a, b = a[keep], b[keep]
    down = b[:, 0] > a[:, 0]
    lo = np.where(down[:, None], a, b)
    hi = np.where(down[:, None], b, a)
    slope = (hi[:, 1] - lo[:, 1]) / (hi[:, 0] - lo[:, 0])
    return lo[:, 0], hi[:, 0], lo[:, 1], slope, np.where(down, 1.0, -1.0)


def fill_polygon(
    rings: Sequence[np.ndarray],
    shape: tuple[int, int],
    *,
    origin: tuple[float, float] = (0.0, 0.0),
    rule: FillRule = "nonzero",
    band: int = DEFAULT_BAND,
) -> np.ndarray:
    """Which pixels of an ``(h, w)`` array lie inside the polygon made of ``rings``.

    Args:
        rings: ``(N, 2)`` arrays of ``(y, x)`` vertices (open or closed), all
            filled together by ``rule``.
        shape: ``(h, w)`` of the result.
        origin: the coordinates of the array's top-left corner: pixel
            ``(i, j)`` has its centre at ``(origin[0] + i + 0.5, origin[1] + j + 0.5)``.
        rule: ``"nonzero"`` winding or ``"evenodd"``.
        band: rows filled at once (the result does not depend on it).

    Returns:
        A boolean ``(h, w)`` array.
    """
    h, w = int(shape[0]), int(shape[1])
    out = np.zeros((h, w), dtype=bool)
    y_lo, y_hi, x_lo, slope, direction = _edges(rings)
    if h == 0 or w == 0 or len(y_lo) == 0:
        return out
    oy, ox = float(origin[0]), float(origin[1])
    # Row i is crossed when y_lo <= oy + i + 0.5 < y_hi.
    first = np.ceil(y_lo - oy - 0.5)
    stop = np.ceil(y_hi - oy - 0.5)
    weights = direction if rule == "nonzero" else np.ones_like(direction)
    band = max(1, int(band))
    for r0 in range(0, h, band):
        r1 = min(h, r0 + band)
        a = np.maximum(first, r0)
        b = np.minimum(stop, r1)
        sel = np.nonzero(b > a)[0]
        if len(sel) == 0:
            continue
        a_i = a[sel].astype(np.int64)
        counts = b[sel].astype(np.int64) - a_i
        total = int(counts.sum())
        edge = np.repeat(sel, counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(a_i, counts) + (np.arange(total) - starts)
        yc = oy + rows + 0.5
        xc = x_lo[edge] + (yc - y_lo[edge]) * slope[edge]
        # The first pixel whose centre lies strictly right of the crossing.
        col = np.clip(np.floor(xc - ox + 0.5), 0, w).astype(np.int64)
        flat = (rows - r0) * (w + 1) + col
        acc = np.bincount(flat, weights=weights[edge], minlength=(r1 - r0) * (w + 1))
        winding = np.cumsum(acc.reshape(r1 - r0, w + 1)[:, :w], axis=1)
        if rule == "nonzero":
            out[r0:r1] = np.rint(winding) != 0
        else:
            out[r0:r1] = np.rint(winding).astype(np.int64) % 2 == 1
    return out


def _bbox(rings: Sequence[np.ndarray]) -> tuple[float, float, float, float]:
    pts = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1, 2) for r in rings])
    return (
        float(pts[:, 0].min()),
        float(pts[:, 1].min()),
        float(pts[:, 0].max()),
        float(pts[:, 1].max()),
    )


def rasterize_labels(
    polygons: Sequence[LabelledPolygon],
    window: tuple[int, int, int, int],
    *,
    band: int = DEFAULT_BAND,
) -> np.ndarray:
    """The ``uint8`` label image of ``window = (y0, x0, y1, x1)``; polygons in the same coordinates.

    Positive labels in increasing order (larger wins), each polygon minus its
    holes; then label-0 polygons (exclusions) clear what they cover.
    """
    y0, x0, y1, x1 = window
    out = np.zeros((y1 - y0, x1 - x0), dtype=np.uint8)
    order = sorted(
        (p for p in polygons if len(p.rings) and len(p.rings[0]) >= 3),
        key=lambda p: (p.label == 0, p.label),
    )
    for poly in order:
        top, left, bottom, right = _bbox(poly.rings[:1])
        # Pixels whose centre may be inside: i + 0.5 in [top, bottom].
        r0 = max(y0, math.floor(top - 0.5))
        r1 = min(y1, math.ceil(bottom - 0.5) + 1)
        c0 = max(x0, math.floor(left - 0.5))
        c1 = min(x1, math.ceil(right - 0.5) + 1)
        if r0 >= r1 or c0 >= c1:
            continue
        shape, origin = (r1 - r0, c1 - c0), (float(r0), float(c0))
        inside = fill_polygon(poly.rings[:1], shape, origin=origin, band=band)
        for hole in poly.rings[1:]:
            inside &= ~fill_polygon([hole], shape, origin=origin, band=band)
        out[r0 - y0 : r1 - y0, c0 - x0 : c1 - x0][inside] = poly.label
    return out


class MaskRenderer:
    """The label image of one slide's canvas, rendered on demand one region at a time.

    A :class:`~hyfi_imaging.io.zarr_store.RegionSource` of shape ``(1, H, W)``,
    uint8: annotation polygons (level-0 coordinates) are moved onto the
    canvas with ``plan.to_canvas`` once, and each region is rasterized inside
    the plan's placement (0 outside it).
    """

    dtype = np.dtype(np.uint8)

    def __init__(
        self,
        polygons: Sequence[LabelledPolygon],
        plan: CropPlan,
        size: tuple[int, int],
        *,
        band: int = DEFAULT_BAND,
    ) -> None:
        self.plan = plan
        self.band = band
        self._shape = (1, int(size[0]), int(size[1]))
        self.polygons = [
            LabelledPolygon(
                p.label, tuple(np.stack(plan.to_canvas(r[:, 0], r[:, 1]), axis=1) for r in p.rings)
            )
            for p in polygons
        ]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._shape

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
        """Labels of canvas pixels ``[y0, y1) x [x0, x1)`` as ``(1, h, w)`` uint8."""
        out = np.zeros((1, y1 - y0, x1 - x0), dtype=np.uint8)
        py, px, ph, pw = self.plan.placement
        iy0, ix0 = max(y0, py), max(x0, px)
        iy1, ix1 = min(y1, py + ph), min(x1, px + pw)
        if iy0 < iy1 and ix0 < ix1 and self.polygons:
            out[0, iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0] = rasterize_labels(
                self.polygons, (iy0, ix0, iy1, ix1), band=self.band
            )
        return out

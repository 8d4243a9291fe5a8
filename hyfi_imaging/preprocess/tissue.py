"""Tissue detection on a slide thumbnail.

Why Otsu on two channels with floors: bright-field slides are white glass with
coloured tissue, so tissue is *darker* (grey level) and *more saturated* than
the background. Otsu picks each threshold from the thumbnail's own histogram,
which adapts to stain and scanner; the absolute floors stop Otsu from splitting
the noise of an empty slide into "tissue" (it always finds *some* threshold).
Small specks are removed and holes closed so the crop box follows the tissue,
not dust.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage
from skimage import filters, morphology

__all__ = ["TISSUE_MIN_FRACTION", "tissue_box", "tissue_mask"]

#: A mask covering less than this fraction of the thumbnail counts as "no tissue".
TISSUE_MIN_FRACTION = 0.0005

# Glass is brighter than this grey level and less saturated than this, whatever Otsu says.
_GLASS_GREY = 235.0
_GLASS_SATURATION = 0.06


def tissue_mask(rgb: np.ndarray, *, min_object_fraction: float = 0.0005) -> np.ndarray:
    """Boolean ``(h, w)`` tissue mask of a uint8 ``(C, h, w)`` thumbnail."""
    img = rgb.astype(np.float32)
    if img.shape[0] == 1:
        img = np.repeat(img, 3, axis=0)
    grey = img[:3].mean(axis=0)
    hi, lo = img[:3].max(axis=0), img[:3].min(axis=0)
    saturation = (hi - lo) / np.maximum(hi, 1.0)
    if float(grey.max() - grey.min()) < 4.0 and float(saturation.max()) < _GLASS_SATURATION:
        return np.zeros(grey.shape, dtype=bool)
    t_grey = min(float(filters.threshold_otsu(grey)), _GLASS_GREY)
    t_sat = max(float(filters.threshold_otsu(saturation)), _GLASS_SATURATION)
    mask = (grey < t_grey) | (saturation > t_sat)
    mask = ndimage.binary_opening(mask, structure=morphology.disk(1))
    mask = morphology.remove_small_objects(
        mask, max_size=max(1, int(min_object_fraction * mask.size))
    )
    mask = morphology.remove_small_holes(mask, max_size=max(1, int(0.01 * mask.size)))
    return np.asarray(mask, dtype=bool)


def tissue_box(
    mask: np.ndarray, downsample: float, image_hw: tuple[int, int], *, margin: int = 0
) -> tuple[int, int, int, int] | None:
    """Bounding box ``(y, x, h, w)`` of the mask in level-0 pixels, grown by ``margin``.

    ``downsample`` is level-0 pixels per mask pixel. The box is clipped to the
    image; ``None`` when the mask is (nearly) empty.
    """
    if mask.mean() < TISSUE_MIN_FRACTION:
        return None
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    height, width = image_hw
    y0 = max(0, int(np.floor(rows[0] * downsample)) - margin)
    x0 = max(0, int(np.floor(cols[0] * downsample)) - margin)
    y1 = min(height, int(np.ceil((rows[-1] + 1) * downsample)) + margin)
    x1 = min(width, int(np.ceil((cols[-1] + 1) * downsample)) + margin)
    return y0, x0, y1 - y0, x1 - x0

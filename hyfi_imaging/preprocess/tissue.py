"""Tissue detection on a slide thumbnail.

Why Otsu on two channels with floors: bright-field slides are white glass with
coloured tissue, so tissue is *darker* (grey level) and *more saturated* than
the background. Otsu picks each threshold from the thumbnail's own histogram,
which adapts to stain and scanner; the absolute floors stop Otsu from splitting
the noise of an empty slide into "tissue" (it always finds *some* threshold).
Small specks are removed and holes closed so the crop box follows the tissue,
not dust.

Intensity images (fluorescence, multiplex, grayscale, 16-bit scientific; see
:mod:`hyfi_imaging.io.pixels`) are the other way round: a dark background and
tissue where there is signal. Each channel used (all of them, or the one
``channel`` names, e.g. DAPI) is scaled to ``[0, 1]`` between its own 1st and
99.9th percentile on the thumbnail, so a dim marker counts as much as a bright
one whatever the bit depth, and thresholded by Otsu on its own. The floor
here: a channel counts only when the two classes Otsu finds differ by at least
``_MIN_SEPARATION`` standard deviations of the darker one, which noise never
does (Gaussian noise split by Otsu: about 2.7); the tissue is the union of the
channels that count, none of them meaning a blank slide.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage
from skimage import filters, morphology

from hyfi_imaging.io.pixels import dtype_range

__all__ = ["TISSUE_MIN_FRACTION", "tissue_box", "tissue_mask"]

#: A mask covering less than this fraction of the thumbnail counts as "no tissue".
TISSUE_MIN_FRACTION = 0.0005

# Glass is brighter than this grey level and less saturated than this, whatever Otsu says.
_GLASS_GREY = 235.0
_GLASS_SATURATION = 0.06
# Intensity images: the tissue class must stand this many background standard deviations out.
_MIN_SEPARATION = 4.0
_SIGNAL_PERCENTILES = (1.0, 99.9)


def _bright_field(image: np.ndarray) -> np.ndarray | None:
    """Tissue of an RGB thumbnail (darker, more saturated than glass); None for a blank one."""
    img = image.astype(np.float32)
    top = dtype_range(image.dtype)[1]
    if top != 255.0:  # the floors are grey levels of 8-bit images
        img *= np.float32(255.0 / top)
    if img.shape[0] == 1:
        img = np.repeat(img, 3, axis=0)
    grey = img[:3].mean(axis=0)
    hi, lo = img[:3].max(axis=0), img[:3].min(axis=0)
    saturation = (hi - lo) / np.maximum(hi, 1.0)
    if float(grey.max() - grey.min()) < 4.0 and float(saturation.max()) < _GLASS_SATURATION:
        return None
    t_grey = min(float(filters.threshold_otsu(grey)), _GLASS_GREY)
    t_sat = max(float(filters.threshold_otsu(saturation)), _GLASS_SATURATION)
    return np.asarray((grey < t_grey) | (saturation > t_sat))


def _intensity(image: np.ndarray, channel: int | None) -> np.ndarray | None:
    """Tissue of an intensity thumbnail (signal over a dark background); None for a blank one.

    Each channel is thresholded on its own (Otsu) and kept only when its two
    classes stand apart; the tissue is the union of the kept channels, so a
    channel of pure noise (an empty marker) adds nothing.
    """
    found: np.ndarray | None = None
    for c in range(image.shape[0]) if channel is None else (channel,):
        v = image[c].astype(np.float32)
        lo, hi = (float(q) for q in np.percentile(v, _SIGNAL_PERCENTILES))
        if not hi > lo:
            continue
        signal = np.clip((v - np.float32(lo)) / np.float32(hi - lo), 0, 1)
        mask = signal > float(filters.threshold_otsu(signal))
        back = signal[~mask]
        if not mask.any() or back.size == 0:
            continue
        if float(signal[mask].mean() - back.mean()) < _MIN_SEPARATION * float(back.std()):
            continue
        found = mask if found is None else found | mask
    return found


def tissue_mask(
    image: np.ndarray,
    *,
    rgb: bool = True,
    channel: int | None = None,
    min_object_fraction: float = 0.0005,
) -> np.ndarray:
    """Boolean ``(h, w)`` tissue mask of a ``(C, h, w)`` thumbnail of any supported type.

    ``rgb``: a bright-field image (tissue darker than white glass), else an
    intensity image (tissue brighter than a dark background), on ``channel``
    alone when given, else on every channel.
    """
    found = _bright_field(image) if rgb else _intensity(image, channel)
    if found is None:
        return np.zeros(image.shape[1:], dtype=bool)
    mask = ndimage.binary_opening(found, structure=morphology.disk(1))
    mask = morphology.remove_small_objects(
        mask, max_size=max(1, int(min_object_fraction * mask.size))
    )
    mask = morphology.remove_small_holes(mask, max_size=max(1, int(0.01 * mask.size)))
    return np.asarray(mask, dtype=bool)


def tissue_box(
    mask: np.ndarray,
    downsample: float | tuple[float, float],
    image_hw: tuple[int, int],
    *,
    margin: int = 0,
) -> tuple[int, int, int, int] | None:
    """Bounding box ``(y, x, h, w)`` of the mask in level-0 pixels, grown by ``margin``.

    ``downsample`` is level-0 pixels per mask pixel, one number or ``(dy, dx)``.
    The box is clipped to the image; ``None`` when the mask is (nearly) empty.
    """
    if mask.mean() < TISSUE_MIN_FRACTION:
        return None
    dy, dx = downsample if isinstance(downsample, tuple) else (downsample, downsample)
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    height, width = image_hw
    y0 = max(0, int(np.floor(rows[0] * dy)) - margin)
    x0 = max(0, int(np.floor(cols[0] * dx)) - margin)
    y1 = min(height, int(np.ceil((rows[-1] + 1) * dy)) + margin)
    x1 = min(width, int(np.ceil((cols[-1] + 1) * dx)) + margin)
    return y0, x0, y1 - y0, x1 - x0

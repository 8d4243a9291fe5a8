"""Tissue detection on a slide thumbnail, and the check that the crop kept it.

Why two rules. Bright-field slides (H&E, IHC: RGB over white glass) have
tissue *darker* and *more saturated* than the glass: Otsu on grey level and
saturation, with absolute floors so that the noise of an empty slide is not
"tissue" (Otsu always finds *some* threshold). Specks smaller than
``min_object_fraction`` of the thumbnail are dust and are dropped.

Everything else (fluorescence, multiplex QPTIFF/OME-TIFF, 16-bit grey scans,
and RGB images whose border is dark) is taken channel by channel against its
own background, because a threshold drawn from a channel's brightest pixels
misses the tissue: on a Vectra QPTIFF, Otsu between the 1st and 99.9th
percentile of DAPI kept a dozen bright nuclear clusters and cut 30 % of the
core; on a 16-bit scan, isolated cells near the edges were dropped as specks.
So, per channel, on the thumbnail smoothed by a Gaussian of ``_SMOOTH_PX``:

* the **background** is the median of the thumbnail's outer frame (5 % of
  each side: slides and cores are scanned with empty space around them) and
  its **noise** 1.4826 x the frame's median absolute deviation, floored at
  half a grey level (integer types) and at ``_NOISE_FLOOR_SHARE`` of the
  channel's range (a background that varies more than that reads as signal:
  the crop then keeps more, never less);
* the **modality** follows from where the background sits: near the
  channel's bright end (glass in a grey bright-field scan) the signal is
  ``background - value``, otherwise ``value - background``;
* a pixel has **signal** where that difference is ``_EXTENT_SIGMAS`` noise
  levels out and connected to one that is ``_SEED_SIGMAS`` out (hysteresis):
  pure noise never is, while a single dim cell or a faint autofluorescent
  core is, however small, whatever the bit depth or the brightest marker.

Channels are combined by their union (a pixel is tissue when any channel
used has signal there): the one ``--tissue CHANNEL`` names, or all of them.
No speck is removed on this path: its specks are significant by
construction, and a dropped one would be tissue cut without a word.

Both rules end with a closing (gaps of a few thumbnail pixels between nuclei
or fragments are tissue) and hole filling. The crop is the mask's bounding
box plus a margin (in µm; :mod:`~hyfi_imaging.preprocess.convert`), and
:func:`lost_signal_warning` then measures what it left out against the
*signal* of every channel (bright-field: the raw dark/saturated pixels,
specks included): more than :data:`SIGNAL_OUTSIDE_SHARE` of the signal
inside is reported in the log and the manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import ndimage
from skimage import filters, morphology

from hyfi_imaging.io.pixels import dtype_range

__all__ = [
    "SIGNAL_OUTSIDE_SHARE",
    "TISSUE_MIN_FRACTION",
    "Tissue",
    "crop_margin",
    "find_tissue",
    "lost_signal_warning",
    "signal_outside",
    "tissue_box",
    "tissue_mask",
]

#: Bright-field objects covering less than this fraction of the thumbnail are dust.
TISSUE_MIN_FRACTION = 0.0005
#: Signal outside the crop above this share of the signal inside is warned about.
SIGNAL_OUTSIDE_SHARE = 0.01

# Glass is brighter than this grey level and less saturated than this, whatever Otsu says.
_GLASS_GREY = 235.0
_GLASS_SATURATION = 0.06
# Intensity images: Gaussian smoothing of the thumbnail (pixels), and the hysteresis levels.
_SMOOTH_PX = 1.0
_EXTENT_SIGMAS = 3.0
_SEED_SIGMAS = 8.0
# The noise level is at least this share of the channel's range (background to 99.9th pct).
_NOISE_FLOOR_SHARE = 0.002
# The outer frame the background is measured on, as a share of each side.
_FRAME_SHARE = 0.05
# An RGB image whose frame is darker than this share of the range is not on glass.
_DARK_FRAME = 0.25
# Gaps between tissue pieces closed, in thumbnail pixels.
_CLOSING_PX = 2
# The margin of a slide whose µm/px is unknown, in thumbnail pixels.
_MARGIN_THUMB_PX = 2


@dataclass(frozen=True)
class Tissue:
    """What was found on a thumbnail.

    ``mask``: the tissue the crop box is drawn around (closed, holes filled).
    ``signal``: every pixel with signal on *any* channel, before specks are
    dropped, which the crop is checked against (:func:`lost_signal_warning`).
    ``modality``: ``"bright-field"`` (RGB on glass), ``"intensity"``, or
    ``"none"`` (``--tissue none``: no detection, the whole image).
    """

    mask: np.ndarray
    signal: np.ndarray
    modality: str


def _frame(v: np.ndarray) -> np.ndarray:
    """The pixels of the outer frame of a ``(h, w)`` image (all of a tiny one)."""
    h, w = v.shape
    by, bx = max(1, round(h * _FRAME_SHARE)), max(1, round(w * _FRAME_SHARE))
    if 2 * by >= h or 2 * bx >= w:
        return v.ravel()
    inner = v[by:-by]
    return np.concatenate(
        [v[:by].ravel(), v[-by:].ravel(), inner[:, :bx].ravel(), inner[:, -bx:].ravel()]
    )


def _significance(v: np.ndarray, integer: bool) -> np.ndarray:
    """A channel's signal in noise levels of its background (0 where it has none)."""
    smooth = ndimage.gaussian_filter(v.astype(np.float32), _SMOOTH_PX)
    frame = _frame(smooth)
    back = float(np.median(frame))
    lo, hi = (float(q) for q in np.percentile(smooth, (0.1, 99.9)))
    bright_back = back - lo > hi - back  # glass in a grey bright-field scan
    span = back - lo if bright_back else hi - back
    noise = max(
        1.4826 * float(np.median(np.abs(frame - back))),
        0.5 if integer else 0.0,
        _NOISE_FLOOR_SHARE * span,
    )
    if not noise > 0:  # a constant channel
        return np.zeros(v.shape, dtype=np.float32)
    diff = back - smooth if bright_back else smooth - back
    return np.asarray(diff / np.float32(noise), dtype=np.float32)


def _has_signal(significance: np.ndarray) -> np.ndarray:
    """Pixels ``_EXTENT_SIGMAS`` out, connected to one ``_SEED_SIGMAS`` out."""
    return np.asarray(
        filters.apply_hysteresis_threshold(significance, _EXTENT_SIGMAS, _SEED_SIGMAS), dtype=bool
    )


def _grey_255(image: np.ndarray) -> np.ndarray:
    """Grey level of an RGB (or one-channel) image on the 0-255 scale the glass floors use."""
    img = image[:3].astype(np.float32)
    top = dtype_range(image.dtype)[1]
    if top != 255.0:
        img *= np.float32(255.0 / top)
    return np.asarray(img.mean(axis=0))


def _dark_frame(image: np.ndarray) -> bool:
    """True when an RGB image is not on glass: its frame is dark (fluorescence saved as RGB)."""
    return float(np.median(_frame(_grey_255(image)))) < _DARK_FRAME * 255.0


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


def _close(mask: np.ndarray) -> np.ndarray:
    """Closing that never loses a pixel at the image edge (scipy erodes from a 0 border)."""
    r = _CLOSING_PX
    padded = np.pad(mask, r)
    closed = ndimage.binary_closing(padded, structure=morphology.disk(r))[r:-r, r:-r]
    return np.asarray(closed | mask)


def find_tissue(
    image: np.ndarray,
    *,
    rgb: bool = True,
    channel: int | None = None,
    min_object_fraction: float = TISSUE_MIN_FRACTION,
) -> Tissue:
    """Tissue and signal of a ``(C, h, w)`` thumbnail of any supported type.

    ``rgb``: the channels are red, green, blue; such an image is bright-field
    unless its frame is dark. Intensity images are detected on ``channel``
    alone when given, else on every channel; their signal is always taken
    over every channel.
    """
    empty = np.zeros(image.shape[1:], dtype=bool)
    if rgb and not _dark_frame(image):
        raw = _bright_field(image)
        if raw is None:
            return Tissue(empty, empty, "bright-field")
        signal = np.asarray(ndimage.binary_opening(raw, structure=morphology.disk(1)))
        mask = morphology.remove_small_objects(
            _close(signal), max_size=max(1, int(min_object_fraction * signal.size))
        )
        return Tissue(np.asarray(ndimage.binary_fill_holes(mask)), signal, "bright-field")
    integer = image.dtype.kind in "ui"
    per_channel = [_has_signal(_significance(image[c], integer)) for c in range(image.shape[0])]
    used = per_channel if channel is None or rgb else [per_channel[channel]]
    found = np.logical_or.reduce(used) if used else empty
    mask = np.asarray(ndimage.binary_fill_holes(_close(found)))
    return Tissue(mask, np.logical_or.reduce(per_channel), "intensity")


def tissue_mask(
    image: np.ndarray,
    *,
    rgb: bool = True,
    channel: int | None = None,
    min_object_fraction: float = TISSUE_MIN_FRACTION,
) -> np.ndarray:
    """Boolean ``(h, w)`` tissue mask of a ``(C, h, w)`` thumbnail (:func:`find_tissue`)."""
    return find_tissue(
        image, rgb=rgb, channel=channel, min_object_fraction=min_object_fraction
    ).mask


def tissue_box(
    mask: np.ndarray,
    downsample: float | tuple[float, float],
    image_hw: tuple[int, int],
    *,
    margin: int = 0,
) -> tuple[int, int, int, int] | None:
    """Bounding box ``(y, x, h, w)`` of the mask in level-0 pixels, grown by ``margin``.

    ``downsample`` is level-0 pixels per mask pixel, one number or ``(dy, dx)``.
    The box is clipped to the image; ``None`` when the mask is empty.
    """
    if not mask.any():
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


def crop_margin(margin_um: float, mpp: float | None, downsample: tuple[float, float]) -> int:
    """The margin around the tissue box in level-0 pixels: ``margin_um`` at ``mpp``.

    A slide of unknown µm/px cannot have a margin in µm; it gets
    ``_MARGIN_THUMB_PX`` thumbnail pixels (``downsample``: level-0 pixels per
    thumbnail pixel), so that the thumbnail's own blur never puts tissue on
    the crop's edge.
    """
    if mpp is not None:
        return round(margin_um / mpp)
    return math.ceil(_MARGIN_THUMB_PX * max(downsample)) if margin_um > 0 else 0


def signal_outside(
    signal: np.ndarray, box: tuple[int, int, int, int], downsample: tuple[float, float]
) -> float:
    """Signal pixels of the thumbnail outside ``box`` (level 0) per signal pixel inside it.

    A thumbnail pixel is inside when its centre is. ``inf`` when all the
    signal is outside, 0 when there is none.
    """
    y, x, h, w = box
    dy, dx = downsample
    rows = (np.arange(signal.shape[0]) + 0.5) * dy
    cols = (np.arange(signal.shape[1]) + 0.5) * dx
    inside = np.outer((rows >= y) & (rows < y + h), (cols >= x) & (cols < x + w))
    n_in = int(np.count_nonzero(signal & inside))
    n_out = int(np.count_nonzero(signal & ~inside))
    if n_in == 0:
        return math.inf if n_out else 0.0
    return n_out / n_in


def lost_signal_warning(
    signal: np.ndarray,
    downsample: tuple[float, float],
    *,
    tissue_box: tuple[int, int, int, int],
    crop: tuple[int, int, int, int],
    detect_on: str = "auto",
) -> str | None:
    """The line that says the crop left signal out, with the fix; ``None`` when it did not.

    ``tissue_box`` is the detector's box (margin included), ``crop`` the
    source box finally read (``--fit crop`` may have cut it further), and
    ``detect_on`` the ``--tissue`` value, which decides the advice.
    """
    share = signal_outside(signal, crop, downsample)
    if share <= SIGNAL_OUTSIDE_SHARE:
        return None
    said = "all" if math.isinf(share) else f"{share:.1%} of that inside"
    if signal_outside(signal, tissue_box, downsample) <= SIGNAL_OUTSIDE_SHARE:
        fix = "--fit fit or a larger --size keeps it"
    elif detect_on == "auto":
        fix = "check the QC picture, and keep the whole image with --tissue none"
    else:
        fix = (
            f"check the QC picture; --tissue {detect_on} detects on one channel, "
            "--tissue auto on every channel, --tissue none keeps the whole image"
        )
    return (
        f"the crop (source box {list(crop)}) leaves signal out: {said} lies outside it "
        f"on the thumbnail; {fix}"
    )

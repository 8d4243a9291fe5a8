"""Vendor whole-slide formats (SVS, NDPI, MRXS, ...) through OpenSlide.

Why a thin wrapper: OpenSlide already knows every vendor's tile layout; what
it does differently from the rest of hyfi-imaging is converted here, once:

* OpenSlide speaks ``(x, y)`` / ``(w, h)`` and takes the region origin in
  level-0 pixels; we speak ``(y, x)`` / ``(h, w)`` in the pixels of the level
  read.
* OpenSlide returns premultiplied RGBA where transparent means "no data"
  (outside the image, gaps between MRXS tiles). Compositing premultiplied
  RGBA over the background ``b`` is ``rgb + b·(255 - a)/255`` per pixel, which
  turns no-data pixels into background and leaves opaque pixels untouched.
* Level pixels are exact where OpenSlide's level downsample is an integer.
  Where it is not (e.g. a 2049-px slide whose level 1 has 1025 px: 1.9988),
  OpenSlide takes a level-0 origin and resamples by the sub-pixel remainder;
  we round the origin to the nearest level-0 pixel, so values may differ by a
  few grey levels from the stored tiles (measured <= 11 on a noisy image). Use
  :class:`~hyfi_imaging.io.tiff_reader.TiffReader` when exact pyramid pixels
  matter for a TIFF-based file. The levels below the first of a TIFF-based file
  (:meth:`OpenSlideReader._tiff_pages`) and of a DICOM series
  (:meth:`OpenSlideReader._dicom_frames`) are read from their own pages or frames
  where tifffile or :class:`~hyfi_imaging.io.dicom_reader.DicomReader` reads the
  same levels; a DICOM level OpenSlide would interpolate is otherwise refused.
* Geometry: ``level_downsamples`` are per axis and exact
  (:func:`~hyfi_imaging.io.base.level_downsample`: that 1025-px level is the
  2x grid); OpenSlide's own averaged downsample is used only to convert our
  level coordinates into the level-0 origin OpenSlide's API takes.
* MPP: ``openslide.mpp-x/y`` come from vendor metadata, except for the
  ``generic-tiff`` driver, where OpenSlide 4 derives them from the TIFF
  resolution tags (measured: a tiled TIFF with XResolution 20000/cm reports
  ``openslide.mpp-x = 0.5``); those are labelled ``"tiff-resolution"``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import BACKGROUND, level_downsample, read_filled
from hyfi_imaging.io.budget import default_memory_budget
from hyfi_imaging.io.pixels import RGB_COLORS, RGB_NAMES

__all__ = ["OpenSlideReader", "mpp_from_resolution", "square_mpp"]

#: Microscopy pixel sizes outside this range (µm) are not believed: a
#: resolution tag of 72 dpi (353 µm) describes a screen, not a slide.
MPP_PLAUSIBLE = (1e-3, 100.0)


#: Pixel sides (x, y) further apart than this are not one resolution (relative).
MPP_SQUARE = 0.01


def square_mpp(where: object, x: float | None, y: float | None) -> float | None:
    """One µm/px from a pixel's width ``x`` and height ``y`` (either may be unknown or
    implausible), their mean where they agree within :data:`MPP_SQUARE`.

    Raises SlideError where they do not: every step downstream (the resampling to ``--mpp``,
    the stores' scale, the masks) has one resolution for both axes, and a mean would give
    the image the wrong physical size in both.
    """
    known = [v for v in (x, y) if v is not None and MPP_PLAUSIBLE[0] <= v <= MPP_PLAUSIBLE[1]]
    if len(known) == 2 and abs(known[0] - known[1]) > MPP_SQUARE * min(known):
        raise SlideError(
            where,
            f"its pixels are not square ({known[0]:g} µm wide, {known[1]:g} µm high); "
            "hyfi-preprocess takes one resolution for both axes",
            "resample the slide to square pixels first, or pass --mpp-override MICRONS if "
            "its metadata is wrong",
        )
    return sum(known) / len(known) if known else None


def mpp_from_resolution(resolution: float | None, unit: str | None) -> float | None:
    """Microns per pixel from a TIFF resolution (pixels per ``unit``), or ``None``.

    ``unit`` is ``"centimeter"`` or ``"inch"`` (case-insensitive); anything
    else (``"none"``, missing) means the file does not know its scale.
    """
    if not resolution or resolution <= 0 or unit is None:
        return None
    per_unit = {"centimeter": 1e4, "inch": 25400.0}.get(unit.lower())
    if per_unit is None:
        return None
    mpp = per_unit / resolution
    return mpp if MPP_PLAUSIBLE[0] <= mpp <= MPP_PLAUSIBLE[1] else None


class OpenSlideReader:
    """A :class:`~hyfi_imaging.io.base.SlideReader` over ``openslide.OpenSlide``.

    Args:
        path: a file OpenSlide can open.
        mpp_override: microns per level-0 pixel that win over the metadata.
        memory_budget: bytes one read may take (default:
            :func:`~hyfi_imaging.io.budget.default_memory_budget`); a read over
            it is refused before OpenSlide decodes anything.

    Raises:
        SlideError: OpenSlide cannot open or read the file, or a read is over
            the memory budget.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mpp_override: float | None = None,
        memory_budget: int | None = None,
    ) -> None:
        import openslide

        self.path = str(path)
        try:
            self._slide: Any = openslide.OpenSlide(self.path)
        except Exception as err:  # OpenSlideError, OpenSlideUnsupportedFormatError, OSError
            raise SlideError(
                self.path,
                f"OpenSlide cannot open the file ({err})",
                "check that the file is complete and in a format OpenSlide supports",
            ) from err
        props = self._slide.properties
        self.format = str(props.get("openslide.vendor", "openslide"))
        self.level_dimensions = tuple((int(h), int(w)) for w, h in self._slide.level_dimensions)
        self.level_downsamples = tuple(
            level_downsample(self.level_dimensions[0], hw) for hw in self.level_dimensions
        )
        # OpenSlide's API converts a level-0 origin with its own (averaged) downsample.
        self._api_downsamples = tuple(float(d) for d in self._slide.level_downsamples)
        self.channels = 3
        self.dtype: np.dtype[np.generic] = np.dtype(np.uint8)
        self.channel_names: tuple[str, ...] = RGB_NAMES
        self.channel_colors: tuple[str, ...] = RGB_COLORS
        self.background: float = _background(props)
        self.mpp, self.mpp_source = self._mpp(props, mpp_override)
        self.memory_budget = (
            default_memory_budget() if memory_budget is None else int(memory_budget)
        )
        self._why_not_frames = ""
        self._pages = self._dicom_frames() if self.format == "dicom" else self._tiff_pages()

    def _dicom_frames(self) -> Any:
        """A :class:`~hyfi_imaging.io.dicom_reader.DicomReader` of the same DICOM series, for
        the reads below level 0, or None (``_why_not_frames`` then says why).

        Why: as for a TIFF (:meth:`_tiff_pages`), OpenSlide takes the origin in level-0
        pixels and divides it by the level's averaged downsample; where a level's sides are
        not exact fractions of level 0's (161 x 201 over 81 x 101: 1.9888), it interpolated
        between the level's pixels (on random content 98 % of a level-1 read differed from
        the stored frames, by up to 54). The level's own frames are read instead."""
        if self.level_count < 2:
            return None
        from hyfi_imaging.io.dicom_reader import DicomReader

        try:
            frames = DicomReader(self.path, memory_budget=self.memory_budget)
        except Exception as err:  # a series only OpenSlide reads: its exact levels only
            self._why_not_frames = f"{type(err).__name__}: {err}"
            return None
        if (frames.level_dimensions, frames.dtype, frames.channels) != (
            self.level_dimensions,
            self.dtype,
            self.channels,
        ):
            frames.close()
            self._why_not_frames = (
                f"hyfi-imaging's DICOM reader finds levels {frames.level_dimensions}, "
                f"OpenSlide {self.level_dimensions}"
            )
            return None
        frames.background = self.background
        return frames

    def _check_exact(self, level: int) -> None:
        """Refuse a read of a DICOM level that OpenSlide would resample rather than read as
        stored: below level 0, where the series' frames cannot be read here
        (:meth:`_dicom_frames`) and the level's sides are not level 0's over OpenSlide's
        downsample, a whole number."""
        if self.format != "dicom" or level < 1 or self._pages is not None:
            return
        if not 0 < level < self.level_count:
            return  # read_filled says that the level does not exist
        ds = self._api_downsamples[level]
        (h0, w0), (h, w) = self.level_dimensions[0], self.level_dimensions[level]
        if ds == round(ds) and (h * ds, w * ds) == (h0, w0):
            return  # whole level-0 origins fall on the level's own pixels: read as stored
        raise SlideError(
            self.path,
            f"level {level} ({h} x {w} px) of this DICOM series is not level 0 ({h0} x {w0}) "
            f"over a whole factor (OpenSlide's downsample {ds:.4f}), so OpenSlide would "
            "interpolate its pixels, and its frames cannot be read here "
            f"({self._why_not_frames})",
            "read level 0 (--level 0, or --mpp to resample from it), or convert the slide "
            "to TIFF or OME-Zarr",
        )

    def _tiff_pages(self) -> Any:
        """A tifffile reader of the same levels, for the reads below level 0, or None.

        Why: OpenSlide takes a region's origin in level-0 pixels and divides it by the level's
        averaged downsample; where the level's sides are not exact fractions of level 0's
        (an SVS of floor(n / 2) levels: 2.00067), the origin falls between the level's
        pixels and OpenSlide interpolates them (on random content 90 % of a level-1 read
        differed from the level's page, by up to 72). A TIFF-based file (SVS, and other
        vendors' TIFFs) whose levels tifffile finds with the same sizes is read there from
        its pages, as stored; any other format keeps OpenSlide's reads."""
        if self.level_count < 2 or self._slide.properties.get("tiff.ImageDescription") is None:
            return None
        from hyfi_imaging.io.tiff_reader import TiffReader

        try:
            pages = TiffReader(self.path, memory_budget=self.memory_budget)
        except Exception:  # not a TIFF tifffile reads: OpenSlide's reads only
            return None
        same = (
            pages.level_dimensions == self.level_dimensions
            and pages.dtype == self.dtype
            and pages.channel_names == self.channel_names
        )
        if not same:
            pages.close()
            return None
        pages.background = self.background
        return pages

    def _mpp(self, props: Any, override: float | None) -> tuple[float | None, str]:
        if override is not None:
            return float(override), "override"
        x, y = (_number(props.get(f"openslide.mpp-{a}")) for a in "xy")
        mpp = square_mpp(self.path, x, y)
        if mpp is not None:
            source = "tiff-resolution" if self.format == "generic-tiff" else "vendor"
            return mpp, source
        unit = props.get("tiff.ResolutionUnit")
        x, y = (mpp_from_resolution(_number(props.get(f"tiff.{a}Resolution")), unit) for a in "XY")
        mpp = square_mpp(self.path, x, y)
        return (mpp, "tiff-resolution") if mpp is not None else (None, "none")

    @property
    def level_count(self) -> int:
        return len(self.level_dimensions)

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Read ``[y, y+h) x [x, x+w)`` of ``level`` (level pixels) as uint8 ``(3, h, w)``;
        below level 0 from the TIFF's own pages where tifffile reads them
        (:meth:`_tiff_pages`), or a DICOM series' own frames (:meth:`_dicom_frames`; a
        level OpenSlide would interpolate is refused where they cannot be read)."""
        if level > 0 and self._pages is not None:
            return self._pages.read_region(level, y, x, h, w)
        self._check_exact(level)
        ds = self._api_downsamples[level] if 0 <= level < self.level_count else 1.0

        def fetch(y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
            # OpenSlide takes (x, y) in level-0 pixels and a size at the level.
            rgba = self._slide.read_region(
                (round(x0 * ds), round(y0 * ds)), level, (x1 - x0, y1 - y0)
            )
            return _composite(np.asarray(rgba), int(self.background))

        return read_filled(
            self,
            level,
            y,
            x,
            h,
            w,
            fetch,
            fix="the file may be truncated or corrupt; re-copy or re-export it",
            budget=self.memory_budget,
            # OpenSlide hands back the region as RGBA before it is composited.
            decoded=lambda box: 4 * (box[2] - box[0]) * (box[3] - box[1]),
        )

    def close(self) -> None:
        """Release OpenSlide's file handles (and tifffile's)."""
        if self._pages is not None:
            self._pages.close()
        self._slide.close()

    def __enter__(self) -> OpenSlideReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _composite(rgba: np.ndarray, background: int) -> np.ndarray:
    """Premultiplied ``(h, w, 4)`` RGBA over ``background`` -> ``(3, h, w)`` uint8."""
    if rgba[..., 3].min() == 255:  # fully opaque (inside the slide): no compositing, 9x faster
        return np.ascontiguousarray(np.moveaxis(rgba[..., :3], -1, 0))
    rgb = rgba[..., :3].astype(np.uint16)
    alpha = rgba[..., 3:4].astype(np.uint16)
    if background == 255:
        out = rgb + (255 - alpha)
    else:
        out = rgb + (background * (255 - alpha) + 127) // 255
    return np.ascontiguousarray(np.moveaxis(np.minimum(out, 255).astype(np.uint8), -1, 0))


def _background(props: Any) -> int:
    """Fill value: grey level of ``openslide.background-color`` if set, else white."""
    colour = props.get("openslide.background-color")
    try:
        r, g, b = (int(colour[i : i + 2], 16) for i in (0, 2, 4))
    except (TypeError, ValueError):
        return BACKGROUND
    return round((r + g + b) / 3)


def _number(text: object) -> float | None:
    """A property's number, or None where it is missing or not one."""
    try:
        return float(text) if text not in (None, "") else None  # type: ignore[arg-type]
    except ValueError:
        return None

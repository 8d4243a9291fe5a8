"""Generic and OME-TIFF pyramids through tifffile's zarr view.

Why tifffile and not OpenSlide for these: OpenSlide follows only the main IFD
chain, so the SubIFD pyramid of an OME-TIFF shows up as a single level; and
tifffile's zarr store decodes only the tiles a region touches (measured
faster than OpenSlide on the same JPEG-tiled file). Decoding a whole level per
read, as some toolkits do, is never done here.

Pyramid choice: the largest image series that is not a thumbnail, label or
macro; its ``levels`` (SubIFDs, or reduced pages tifffile groups) are the
pyramid. If tifffile reports the reduced pages of a plain multi-page pyramid
as separate series instead, those whose shape is a 2^k-ish reduction of the
base are appended as levels.

Channels: RGB (``YXS``) and planar (``CYX``) layouts both come out as
``(C, h, w)`` in the file's own pixel type (uint8, uint16 or float32) and
channel count: a 16-bit grayscale image is one uint16 channel, a 40-channel
multiplex image 40 channels. RGB (photometric RGB or YCbCr with 3 or 4
samples) is a bright-field image (:mod:`hyfi_imaging.io.pixels`); RGBA is
composited over the white background, and a 4th sample that ExtraSamples calls
unspecified (0: RGBX) is dropped. A base page whose Orientation (tag 274) is not
1 (top-left) is refused at open: its regions would be read as stored, not as a
viewer shows them. Channel names (and colours) come from
the OME-XML ``Channel`` elements of an OME-TIFF (``Name``, ``Color``), or the
``<Name>`` and ``<Color>`` of each page's PerkinElmer description in a QPTIFF;
else ``c0, c1, ...`` and a palette.

MPP, in order: the override; OME ``PhysicalSizeX/Y`` (source ``"ome"``);
Aperio ``MPP`` in an SVS description (``"vendor"``); ``XResolution`` with
``ResolutionUnit`` inch or centimeter (``"tiff-resolution"``); else unknown. The
description and tags are the base level's page (the one read), not page 0,
which may be a preview of another resolution.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import xml.etree.ElementTree as ET
from typing import Any

import numpy as np

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import level_downsample, read_filled
from hyfi_imaging.io.budget import (
    CONCURRENT_CHUNKS,
    check_need,
    declared,
    default_memory_budget,
)
from hyfi_imaging.io.channels import qpi_color
from hyfi_imaging.io.openslide_reader import MPP_PLAUSIBLE, mpp_from_resolution, square_mpp
from hyfi_imaging.io.pixels import (
    cast_to,
    default_background,
    default_channels,
    dtype_range,
    supported_dtype,
)

__all__ = ["check_complete", "TiffReader", "ome_channels", "ome_mpp"]

_SVS_MPP = re.compile(r"\|\s*MPP\s*=\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)")
_ASSOCIATED = {"thumbnail", "label", "macro", "overview"}
#: TIFF Orientation values (tag 274): where the stored first row and column are shown.
_ORIENTATIONS = {
    1: "top-left",
    2: "top-right: mirrored",
    3: "bottom-right: turned 180°",
    4: "bottom-left: flipped",
    5: "left-top: transposed",
    6: "right-top: turned 90° clockwise to view",
    7: "right-bottom: transversed",
    8: "left-bottom: turned 90° counter-clockwise to view",
}
#: Fiji/ImageJ's spellings of a length unit (its description's ``unit=``), in µm.
_IMAGEJ_UNIT_UM = {
    "um": 1.0,
    "µm": 1.0,
    "\\u00B5m": 1.0,
    "micron": 1.0,
    "microns": 1.0,
    "nm": 1e-3,
    "mm": 1e3,
}
_OME_UNIT_UM = {"µm": 1.0, "um": 1.0, "nm": 1e-3, "mm": 1e3, "cm": 1e4, "m": 1e6, "Å": 1e-4}


#: Which OME image a reader reads: its index among the document's images (the series'), and
#: its ``(height, width)`` at full resolution.
OmeImage = tuple[int, tuple[int, int]]


def ome_mpp(
    ome_xml: str | None, where: object = "the OME-XML", image: OmeImage | None = None
) -> float | None:
    """Microns per pixel from the OME ``PhysicalSizeX/Y`` of the image read (``image``, see
    :func:`_ome_pixels`; default the first), or ``None`` (SlideError where they differ:
    :func:`square_mpp`)."""
    pixels = _ome_pixels(ome_xml, image)
    if pixels is None:
        return None
    values: list[float | None] = []
    for axis in ("X", "Y"):
        size = pixels.get(f"PhysicalSize{axis}")
        unit = pixels.get(f"PhysicalSize{axis}Unit", "µm").replace("\u03bc", "\u00b5")  # Greek mu
        scale = _OME_UNIT_UM.get(unit)
        value = None
        if size is not None and scale is not None:
            with contextlib.suppress(ValueError):
                value = float(size) * scale
        values.append(value)
    return square_mpp(where, *values)


def _ratio(tag: Any) -> float | None:
    """A TIFF RATIONAL tag's value, or None."""
    if tag is None:
        return None
    num, den = tag.value
    return num / den if den else None


def _ome_pixels(ome_xml: str | None, image: OmeImage | None = None) -> ET.Element | None:
    """The ``Pixels`` element of the OME image read (``image``: its index among the document's
    images and its ``(height, width)``), or ``None``. The image at that index where its size
    agrees, else the first of that size, else the first: a label image listed before the
    main one gave the slide its 30 µm/px and its channels no names."""
    if not ome_xml:
        return None
    try:
        root = ET.fromstring(ome_xml)
    except ET.ParseError:
        return None
    found = [el for el in root.iter() if el.tag.endswith("}Pixels") or el.tag == "Pixels"]
    if not found or image is None:
        return found[0] if found else None
    index, (h, w) = image

    def sized(el: ET.Element) -> bool:
        return el.get("SizeY") == str(h) and el.get("SizeX") == str(w)

    if 0 <= index < len(found) and sized(found[index]):
        return found[index]
    return next((el for el in found if sized(el)), found[0])


def _ome_color(value: str | None) -> str | None:
    """An OME ``Color`` (a signed 32-bit RGBA integer) as ``RRGGBB``, or ``None``."""
    try:
        rgba = int(value) & 0xFFFFFFFF if value is not None else None
    except ValueError:
        return None
    return None if rgba is None else f"{rgba >> 8:06X}"


def ome_channels(
    ome_xml: str | None, channels: int, image: OmeImage | None = None
) -> tuple[list[str | None], list[str | None]]:
    """Names and ``RRGGBB`` colours of the OME channels of the image read (``image``, see
    :func:`_ome_pixels`; default the first); ``None`` where unsaid.

    Both lists are empty unless the document lists exactly ``channels`` channels.
    """
    pixels = _ome_pixels(ome_xml, image)
    if pixels is None:
        return [], []
    found = [el for el in pixels if el.tag.endswith("}Channel") or el.tag == "Channel"]
    if len(found) != channels:
        return [], []
    return [el.get("Name") or None for el in found], [_ome_color(el.get("Color")) for el in found]


def _qpi_channels(pages: Any) -> tuple[list[str | None], list[str | None]]:
    """``<Name>`` and ``<Color>`` (as ``RRGGBB``) of each page's PerkinElmer-QPI description.

    ``None`` where a page says nothing (or nothing readable).
    """
    names: list[str | None] = []
    colors: list[str | None] = []
    for page in pages:
        try:
            root = ET.fromstring(page.description or "")
            name, color = root.findtext("Name"), root.findtext("Color")
        except ET.ParseError:
            name = color = None
        names.append(name.strip() if name and name.strip() else None)
        colors.append(qpi_color(color))
    return names, colors


def _check_one_plane(path: str, series: Any) -> None:
    """Refuse a series of several planes besides its channels (pages of a stack ``I``, a
    z-stack ``Z``, time ``T``): the first plane alone was read, the rest dropped, exit 0 (three
    fluorescence channels saved as three pages became one)."""
    channel = "S" if "S" in series.axes else "C" if "C" in series.axes else None
    extra = [(a, int(n)) for a, n in zip(series.axes, series.shape, strict=True)
             if a not in ("Y", "X", channel) and int(n) > 1]  # fmt: skip
    if extra:
        planes = " x ".join(f"{n} along {a}" for a, n in extra)
        # a z-stack is a volume: saved as channels it would train as a flat slide
        fix = (
            "a z-stack is a volume: write it with write_ome_zarr_volume and "
            "write_volume_manifest (user guide, section 6. Volumes); channels saved as "
            "pages: save them as channels (OME-TIFF axes CYX)"
            if any(a == "Z" for a, _ in extra)
            else "save the planes as channels (OME-TIFF axes CYX, or an ImageJ hyperstack of "
            "channels), or one plane per file"
        )
        raise SlideError(
            path,
            f"series axes {series.axes} hold {planes} besides its channels; a slide is one "
            "plane (its channels are read, nothing else)",
            fix,
        )


def _yx_shape(series: Any) -> tuple[int, int]:
    axes, shape = series.axes, series.shape
    return int(shape[axes.index("Y")]), int(shape[axes.index("X")])


def check_complete(tif: Any, path: str, pages: Any = None) -> None:
    """Raise SlideError when any tile or strip of ``pages`` (default: all) ends past the file's end.

    OpenSlide reads such files without complaint and returns blank tiles, so
    truncation must be caught here, at open, for every TIFF-based format.
    """
    size = tif.filehandle.size
    for i, page in enumerate(tif.pages if pages is None else pages):
        if page is None or not hasattr(page, "dataoffsets"):
            continue
        ends = [o + n for o, n in zip(page.dataoffsets, page.databytecounts, strict=True) if n]
        if ends and max(ends) > size:
            raise SlideError(
                path,
                f"file is truncated (page {i} data ends at byte {max(ends)}, file has {size})",
                "re-copy or re-export the file",
            )


class TiffReader:
    """A :class:`~hyfi_imaging.io.base.SlideReader` over a tiled (OME-)TIFF pyramid.

    Args:
        path: a TIFF or BigTIFF file.
        mpp_override: microns per level-0 pixel that win over the metadata.
        memory_budget: bytes one read may take (default:
            :func:`~hyfi_imaging.io.budget.default_memory_budget`). A level
            whose strips or tiles alone are over it is refused at open, a read
            over it before decoding (:mod:`hyfi_imaging.io.budget`).

    Raises:
        SlideError: not a readable TIFF, no image series, unsupported layout,
            a strip or tile over the memory budget.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mpp_override: float | None = None,
        memory_budget: int | None = None,
    ) -> None:
        import tifffile
        import zarr

        self.path = str(path)
        try:
            self._tif = tifffile.TiffFile(self.path)
        except Exception as err:
            raise SlideError(
                self.path,
                f"tifffile cannot open the file ({type(err).__name__}: {err})",
                "check that the file is a complete TIFF",
            ) from err
        try:
            levels = self._pick_pyramid()
            base = levels[0]
            self._axes = base.axes
            if "Y" not in self._axes or "X" not in self._axes:
                raise ValueError(f"series axes {self._axes!r} have no Y and X")
            _check_one_plane(self.path, base)
            dtype = supported_dtype(base.dtype)
            if dtype is None:
                raise SlideError(
                    self.path,
                    f"pixel type {np.dtype(base.dtype)} is not supported",
                    "convert the image to uint8, uint16 or float32",
                )
            self.dtype = dtype
            self._check_complete(levels)
            self._arrays = [
                zarr.open_array(self._tif.aszarr(series=s, level=lv), mode="r")
                for s, lv in self._level_keys
            ]
            self.level_dimensions = tuple(_yx_shape(lv) for lv in levels)
        except SlideError:
            self._tif.close()
            raise
        except Exception as err:
            self._tif.close()
            raise SlideError(
                self.path,
                f"unsupported or damaged TIFF ({type(err).__name__}: {err})",
                "convert it to a tiled RGB TIFF or OME-Zarr",
            ) from err
        self.level_downsamples = tuple(
            level_downsample(self.level_dimensions[0], hw) for hw in self.level_dimensions
        )
        self._channel_axis = "S" if "S" in self._axes else ("C" if "C" in self._axes else None)
        source_channels = (
            int(base.shape[self._axes.index(self._channel_axis)]) if self._channel_axis else 1
        )
        key = base.keyframe
        self._key = key  # the base level's page: its tags describe the pixels read
        try:
            self._check_orientation(key)
        except SlideError:
            self._tif.close()
            raise
        photometric = int(getattr(key, "photometric", 1))
        # PHOTOMETRIC RGB (2) or YCbCr (6, decoded to RGB) with 3 or 4 samples per pixel.
        self._rgb = (
            self._channel_axis == "S" and photometric in (2, 6) and source_channels in (3, 4)
        )
        extra = tuple(int(e) for e in getattr(key, "extrasamples", ()))[:1]
        # ExtraSamples 0 (unspecified) is no alpha but some other sample, e.g. the pad byte of
        # RGBX (read as alpha, its 0 made the slide white): dropped, as Pillow does. 1
        # (associated) and 2 (unassociated) are an alpha, and so, as in Pillow, is a 4th
        # sample whose ExtraSamples is missing.
        self._extra = self._rgb and source_channels == 4 and extra == (0,)
        self._alpha = self._rgb and source_channels == 4 and not self._extra
        # ExtraSamples 1: the colour is already multiplied by the alpha (associated).
        self._premultiplied = self._alpha and extra == (1,)
        # MINISWHITE (0): 0 is white; read as brightness, the way every viewer shows it.
        self._inverted = photometric == 0
        if self._inverted and self.dtype == np.float32:
            raise SlideError(
                self.path,
                "floating-point TIFF with photometric MINISWHITE (0 is white: no maximum "
                "to invert against)",
                "convert it to MINISBLACK, or to uint8/uint16",
            )
        # PALETTE (3): indices into a colour map, read as the colours.
        self._palette: np.ndarray | None = None
        if photometric == 3 and source_channels == 1:
            self._palette = _palette_lut(key.colormap)
            self.dtype = self._palette.dtype
            self._rgb = True
        self.channels = 3 if self._rgb else source_channels
        self.channel_names, self.channel_colors = self._channel_meta(base)
        self.background = default_background(self.dtype, rgb=self._rgb)
        self.format = (
            "ome-tiff" if self._tif.is_ome else ("aperio" if self._tif.is_svs else "generic-tiff")
        )
        self.mpp, self.mpp_source = self._mpp(mpp_override)
        self.memory_budget = (
            default_memory_budget() if memory_budget is None else int(memory_budget)
        )
        self._tiled = [bool(lv.keyframe.is_tiled) for lv in levels]
        try:
            self._check_chunks()
        except SlideError:
            self._tif.close()
            raise

    def _check_orientation(self, page: Any) -> None:
        """Refuse a base page whose Orientation (tag 274) is not 1 (top-left): its stored rows
        are not the image as a viewer shows it, and a tiled pyramid's regions are read as
        stored (turning each region read would need the whole level's geometry mirrored)."""
        tag = page.tags.get(274)
        orientation = int(tag.value) if tag is not None else 1
        if orientation != 1:
            name = _ORIENTATIONS.get(orientation, "not a TIFF orientation")
            raise SlideError(
                self.path,
                f"TIFF Orientation (tag 274) is {orientation} ({name}), not 1 (top-left): the "
                "stored rows are not the image as a viewer shows it, and this reader reads "
                "them as stored",
                "rewrite the file upright with Orientation 1 (e.g. vips autorot, or "
                "tifffile.imwrite of the turned array)",
            )

    def _chunk_bytes(self, level: int) -> int:
        """Decoded bytes of one strip or tile of ``level`` (a zarr chunk of the TIFF's view)."""
        arr = self._arrays[level]
        return math.prod(int(c) for c in arr.chunks) * arr.dtype.itemsize

    def _check_chunks(self) -> None:
        """Refuse, at open, a level whose single strip or tile cannot be decoded within the budget."""
        y, x = self._axes.index("Y"), self._axes.index("X")
        for level, arr in enumerate(self._arrays):
            kind = "tile" if self._tiled[level] else "strip"
            check_need(
                self.path,
                f"decoding one {kind} ({arr.chunks[y]} x {arr.chunks[x]} px) of "
                f"{declared(self, level)}",
                2 * self._chunk_bytes(level),
                self.memory_budget,
            )

    def _decoded(self, level: int, box: tuple[int, int, int, int]) -> int:
        """Bytes decoded at once besides the region to read ``box`` of ``level`` (its strips/tiles)."""
        y0, x0, y1, x1 = box
        chunks = self._arrays[level].chunks
        cy, cx = chunks[self._axes.index("Y")], chunks[self._axes.index("X")]
        touched = ((y1 - 1) // cy - y0 // cy + 1) * ((x1 - 1) // cx - x0 // cx + 1)
        if self._channel_axis is not None:  # planar files: one chunk per channel plane
            c = self._axes.index(self._channel_axis)
            touched *= -(-int(self._arrays[level].shape[c]) // int(chunks[c]))
        return 2 * self._chunk_bytes(level) * min(touched, CONCURRENT_CHUNKS)

    def _channel_meta(self, base: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Channel names and colours: RGB's, the OME-XML's, a QPTIFF's page names and colours, or defaults."""
        names, colors = default_channels(self.channels, rgb=self._rgb)
        if self._rgb:
            return names, colors
        found: list[str | None] = []
        found_colors: list[str | None] = []
        if self._tif.is_ome:
            found, found_colors = ome_channels(
                self._tif.ome_metadata, self.channels, self._ome_image
            )
        elif self._tif.is_qpi and len(base.pages) == self.channels:
            found, found_colors = _qpi_channels(base.pages)
        named = tuple(n or d for n, d in zip(found, names, strict=False)) or names
        coloured = tuple(c or d for c, d in zip(found_colors, colors, strict=False)) or colors
        return named, coloured

    def _pick_pyramid(self) -> list[Any]:
        series = [
            s
            for s in self._tif.series
            if s.name.lower() not in _ASSOCIATED and "Y" in s.axes and "X" in s.axes
        ]
        if not series:
            raise SlideError(self.path, "TIFF holds no image series", "check the file")
        index = max(range(len(series)), key=lambda i: int(np.prod(_yx_shape(series[i]))))
        base = series[index]
        full = self._tif.series.index(base)
        self._ome_image: OmeImage = (full, _yx_shape(base))  # its OME image, not the first
        levels = list(base.levels)
        self._level_keys = [(full, i) for i in range(len(levels))]
        if len(levels) == 1:
            # Plain page pyramid split into series: keep proportional reductions.
            h0, w0 = _yx_shape(base)
            for s in series:
                h, w = _yx_shape(s)
                if (h, w) == (h0, w0) or s.axes != base.axes or len(s.levels) != 1:
                    continue
                if s.keyframe.is_tiled and abs(h - h0 * w / w0) <= 1.0:  # same aspect ratio
                    levels.append(s)
                    self._level_keys.append((self._tif.series.index(s), 0))
            order = sorted(range(len(levels)), key=lambda i: -int(np.prod(_yx_shape(levels[i]))))
            levels = [levels[i] for i in order]
            self._level_keys = [self._level_keys[i] for i in order]
        return levels

    def _check_complete(self, levels: list[Any]) -> None:
        """Fail at open, not mid-training, when tile data lies beyond the end of the file."""
        check_complete(self._tif, self.path, [p for level in levels for p in level.pages])

    def _mpp(self, override: float | None) -> tuple[float | None, str]:
        if override is not None:
            return float(override), "override"
        ome = self._tif.ome_metadata if self._tif.is_ome else None
        mpp = ome_mpp(ome, self.path, self._ome_image) if ome else None
        if mpp is not None:
            return mpp, "ome"
        page = self._key  # the base level's page, not page 0 (a preview's 2 µm/px was taken)
        if self._tif.is_svs:
            found = _SVS_MPP.search(page.description or "")
            mpp = float(found.group(1)) if found else None
            if mpp is not None and MPP_PLAUSIBLE[0] <= mpp <= MPP_PLAUSIBLE[1]:
                return mpp, "vendor"
        unit = page.tags.get("ResolutionUnit")
        if unit is not None:
            unit_name = {2: "inch", 3: "centimeter"}.get(int(unit.value))
            x, y = (
                mpp_from_resolution(_ratio(page.tags.get(f"{a}Resolution")), unit_name)
                for a in "XY"
            )
            mpp = square_mpp(self.path, x, y)
            if mpp is not None:
                return mpp, "tiff-resolution"
        # Fiji/ImageJ: ResolutionUnit none, the unit in its description ("unit=um"; "micron",
        # "\\u00B5m" and "mm" too); its X/YResolution are pixels per that unit.
        unit_um = _IMAGEJ_UNIT_UM.get(str((self._tif.imagej_metadata or {}).get("unit", "")))
        if self._tif.is_imagej and unit_um is not None:
            x, y = (
                unit_um / r if (r := _ratio(page.tags.get(f"{a}Resolution"))) else None
                for a in "XY"
            )
            mpp = square_mpp(self.path, x, y)
            if mpp is not None and MPP_PLAUSIBLE[0] <= mpp <= MPP_PLAUSIBLE[1]:
                return mpp, "tiff-resolution"
        return None, "none"

    @property
    def level_count(self) -> int:
        return len(self._arrays)

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Read ``[y, y+h) x [x, x+w)`` of ``level`` as ``(C, h, w)``, touching only its tiles."""

        def fetch(y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
            sel = tuple(
                slice(y0, y1)
                if a == "Y"
                else slice(x0, x1)
                if a == "X"
                else slice(None)
                if a == self._channel_axis
                else 0
                for a in self._axes
            )
            data = np.asarray(self._arrays[level][sel])
            kept = [a for a in self._axes if a in ("Y", "X") or a == self._channel_axis]
            order = [kept.index(a) for a in (self._channel_axis, "Y", "X") if a is not None]
            data = data.transpose(order) if self._channel_axis else data[None]
            if self._palette is not None:
                return self._palette[:, data[0]]
            if self._inverted:
                return np.iinfo(data.dtype).max - data
            if self._extra:
                return data[:3]
            return self._composite(data) if self._alpha else data

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
            decoded=lambda box: self._decoded(level, box),
        )

    def _composite(self, data: np.ndarray) -> np.ndarray:
        """RGBA ``(4, h, w)`` over the white background -> RGB, same type; associated
        (premultiplied) alpha adds only the background's share."""
        if self.dtype == np.uint8:  # the exact integer form hyfi-imaging always used
            a8 = data[3:4].astype(np.uint16)
            colour = data[:3].astype(np.uint16) * (255 if self._premultiplied else a8)
            out = colour + int(self.background) * (255 - a8)
            return np.minimum((out + 127) // 255, 255).astype(np.uint8)
        alpha = data[3:4].astype(np.float64) / dtype_range(self.dtype)[1]
        shade: np.ndarray = data[:3] if self._premultiplied else data[:3] * alpha
        return cast_to(shade + self.background * (1.0 - alpha), self.dtype)

    def close(self) -> None:
        """Close the TIFF file handle."""
        self._arrays = []
        self._tif.close()

    def __enter__(self) -> TiffReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _palette_lut(colormap: np.ndarray | None) -> np.ndarray:
    """A palette TIFF's colour map ``(3, 2**bits)`` (16-bit per TIFF) as the look-up table of
    the colours read: 8-bit where every entry is an 8-bit value scaled by 257, as writers
    store them, else 16-bit."""
    if colormap is None:
        raise ValueError("a palette TIFF without a colour map")
    cmap = np.asarray(colormap, dtype=np.uint16)
    if np.all(cmap % 257 == 0):
        return (cmap // 257).astype(np.uint8)
    return cmap

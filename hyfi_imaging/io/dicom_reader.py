"""DICOM whole-slide images read by their own frame index, where OpenSlide cannot classify them.

Why a reader of our own: OpenSlide 4 sorts the instances of a series by
ImageType (``VOLUME``, ``LABEL``, ``OVERVIEW``) and refuses the whole series
when one instance lacks it ("Couldn't get image flavor"), although ImageType
is the one attribute some converters leave out and the series is otherwise
complete: every instance states its total pixel matrix, its tile size and
where its frames lie. So :func:`~hyfi_imaging.io.detect.open_slide` sends a
series that lacks ImageType here (and one OpenSlide does not detect), and one
OpenSlide would misread: MONOCHROME2 levels (OpenSlide 4: "Couldn't read
PlanarConfiguration") and levels of several optical paths or focal planes
(OpenSlide reads them as one tile-by-tile mix; refused here in one line). It
keeps OpenSlide for the rest, whose levels below the first
:class:`~hyfi_imaging.io.openslide_reader.OpenSlideReader` reads through this
reader too (their stored frames, not OpenSlide's resampling). The series is
read by those other attributes:

* **members**: the VL Whole Slide Microscopy instances of the same series UID
  in the same folder (where OpenSlide looks too);
* **levels** (:func:`pyramid_levels`): instances with a total pixel matrix
  and no ImageType flavour other than ``VOLUME``; the largest is level 0, and
  another is a level when its size is level 0's over one factor, within a
  pixel on both axes. Labels and overviews, which other converters flag by
  ImageType, are told apart without it by that test: their aspect is not the
  slide's. Two instances of one size (focal planes, optical paths,
  concatenations) are refused, not picked from;
* **frames** (:func:`frame_grid`): the per-frame Plane Position (Slide)
  when the file has it (``TILED_SPARSE``), else ``TILED_FULL`` order (row by
  row); missing tiles read as background; a frame wholly outside the total
  pixel matrix, or an instance of several optical paths or focal planes
  (NumberOfOpticalPaths, TotalPixelMatrixFocalPlanes), is refused;
* **pixels**: native 8/16-bit RGB or MONOCHROME2, JPEG baseline and JPEG 2000
  frames through Pillow; other transfer syntaxes are refused in one line at open.

Level geometry, mpp (PixelSpacing of the shared functional groups, in mm)
and reads follow :mod:`hyfi_imaging.io.base` like every reader.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import level_downsample, read_filled
from hyfi_imaging.io.budget import check_need, declared, default_memory_budget
from hyfi_imaging.io.dicom import IMPLICIT_LE, WSI_SOP_CLASS, read_dicom_header
from hyfi_imaging.io.dicom_instance import DicomInstance, read_instance, series_members
from hyfi_imaging.io.openslide_reader import square_mpp
from hyfi_imaging.io.pixels import default_background, default_channels

__all__ = [
    "READABLE_SYNTAXES",
    "DicomReader",
    "check_decodable",
    "frame_grid",
    "pyramid_levels",
]

_NATIVE = {
    IMPLICIT_LE: "implicit VR little endian",
    "1.2.840.10008.1.2.1": "explicit VR little endian",
}
_ENCAPSULATED = {
    "1.2.840.10008.1.2.4.50": "JPEG baseline",
    "1.2.840.10008.1.2.4.51": "JPEG extended",
    "1.2.840.10008.1.2.4.90": "JPEG 2000 lossless",
    "1.2.840.10008.1.2.4.91": "JPEG 2000",
}
#: Transfer syntaxes :class:`DicomReader` decodes (UID -> name).
READABLE_SYNTAXES = {**_NATIVE, **_ENCAPSULATED}
#: Photometric interpretations of encapsulated frames (the decoder gives RGB or grey).
_PHOTOMETRIC = {"RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT", "MONOCHROME2"}
_FIX = (
    "add ImageType (e.g. DERIVED\\PRIMARY\\VOLUME\\NONE) to the series so that OpenSlide reads "
    "it, or convert the slide to TIFF or OME-Zarr"
)


def check_decodable(inst: DicomInstance) -> None:
    """Refuse, in one line, a level whose frames this reader cannot decode."""
    native = inst.syntax in _NATIVE
    allowed = {"RGB", "MONOCHROME2"} if native else _PHOTOMETRIC
    why = None
    if inst.syntax not in READABLE_SYNTAXES:
        why = f"transfer syntax {inst.syntax or '(none)'}"
    elif not inst.tile[0] or not inst.tile[1]:
        why = "frames without Rows and Columns"
    elif inst.photometric not in allowed or inst.samples != (
        1 if "MONO" in inst.photometric else 3
    ):
        why = f"photometric {inst.photometric or '(none)'} with {inst.samples} samples per pixel"
    elif inst.bits not in (8, 16) or (inst.bits == 16 and inst.samples != 1):
        why = f"{inst.bits}-bit samples"
    if why is not None:
        # With ImageType the series came here because OpenSlide cannot read it either.
        raise SlideError(
            inst.path,
            f"{why} is not read without OpenSlide (this reader decodes 8-bit RGB or 8/16-bit "
            f"MONOCHROME2 frames, {', '.join(sorted(set(READABLE_SYNTAXES.values())))})",
            _FIX if inst.image_type is None else "convert the slide to TIFF or OME-Zarr",
        )


def pyramid_levels(instances: list[DicomInstance]) -> list[DicomInstance]:
    """The pyramid levels among a series' instances, level 0 first (see the module docstring).

    Raises:
        SlideError: no instance has a total pixel matrix, or two instances have one size.
    """
    tiled = [i for i in instances if i.size is not None and i.flavor in (None, "VOLUME")]
    if not tiled:
        raise SlideError(
            instances[0].path,
            "no instance of the DICOM series has a total pixel matrix (TotalPixelMatrixRows/"
            "Columns), so none is a pyramid level",
            _FIX,
        )
    tiled.sort(key=lambda i: (-math.prod(i.size or (0, 0)), str(i.path)))
    h0, w0 = tiled[0].size or (0, 0)
    levels: list[DicomInstance] = []
    for inst in tiled:
        h, w = inst.size or (0, 0)
        factor = (h0 / h + w0 / w) / 2
        if abs(h * factor - h0) > factor or abs(w * factor - w0) > factor:
            continue  # another aspect: a label or overview image
        same = [lv for lv in levels if lv.size == inst.size and lv.uid != inst.uid]
        if same:
            raise SlideError(
                inst.path,
                f"two instances of the series are {h} x {w} px ({same[0].path.name} and "
                f"{inst.path.name}: focal planes, optical paths or a concatenation)",
                "export one focal plane and optical path per level, or convert the slide to TIFF",
            )
        if all(lv.uid != inst.uid for lv in levels):
            levels.append(inst)
    return levels


def frame_grid(inst: DicomInstance) -> dict[tuple[int, int], int]:
    """Tile ``(row, column)`` in the grid of ``inst.tile`` -> frame index.

    Raises:
        SlideError: frames without pixels (Rows or Columns 0), several optical paths or
            focal planes, frames off the tile grid or wholly outside the total pixel
            matrix, two frames on one tile, or a frame count that ``TILED_FULL`` order
            cannot place.
    """
    (th, tw), (h, w) = inst.tile, inst.size or inst.tile
    if not th or not tw:
        raise SlideError(
            inst.path,
            f"frames of {th} x {tw} px (Rows, Columns) hold no pixels",
            "the file may be corrupt; re-export it, or convert the slide to TIFF or OME-Zarr",
        )
    if inst.planes > 1:  # their frames share one tile grid: read as one, a tile-by-tile mix
        raise SlideError(
            inst.path,
            f"{inst.optical_paths} optical path(s) and {inst.focal_planes} focal plane(s) in one "
            "instance (NumberOfOpticalPaths, TotalPixelMatrixFocalPlanes): its frames of "
            "different paths or planes lie on one tile grid",
            "export one focal plane and optical path, or convert the slide to TIFF",
        )
    gy, gx = -(-h // th), -(-w // tw)
    grid: dict[tuple[int, int], int] = {}
    if inst.positions is not None:
        for i, (r, c) in enumerate(inst.positions):
            if not (-th < r < h and -tw < c < w):  # wholly outside: no pixel of it is read
                raise SlideError(
                    inst.path,
                    f"frame {i + 1} starts at row {r + 1}, column {c + 1}, outside the "
                    f"{h} x {w} px total pixel matrix",
                    "the frame positions are wrong; re-export the slide, or convert it to TIFF",
                )
            if r % th or c % tw:
                raise SlideError(
                    inst.path,
                    f"frame {i + 1} starts at row {r + 1}, column {c + 1}, off the "
                    f"{th} x {tw} tile grid",
                    "convert the slide to TIFF or OME-Zarr",
                )
            if (r // th, c // tw) in grid:
                raise SlideError(
                    inst.path,
                    f"frames {grid[r // th, c // tw] + 1} and {i + 1} lie on one tile "
                    "(several focal planes or optical paths)",
                    "export one focal plane and optical path, or convert the slide to TIFF",
                )
            grid[r // th, c // tw] = i
        return grid
    if inst.organization not in (None, "TILED_FULL") or len(inst.frames) != gy * gx * inst.planes:
        raise SlideError(
            inst.path,
            f"{len(inst.frames)} frames without per-frame positions (organization "
            f"{inst.organization or 'not stated'}) do not fill the {gy} x {gx} tile grid of a "
            f"{h} x {w} px image",
            _FIX,
        )
    return {(i // gx, i % gx): i for i in range(gy * gx)}


def _jpeg_needs_raw(image: object, photometric: str) -> bool:
    """True when libjpeg would convert an RGB-coded JPEG frame as if it were YCbCr.

    Without a JFIF or Adobe marker, or component ids ``R, G, B``, libjpeg takes
    three components for YCbCr; the DICOM header's photometric RGB says the
    frame holds R, G, B (as in slides converted from Aperio files), so the
    components are taken as they are. Measured: such a frame of one colour
    (200, 30, 60) decodes to (105, 255, 26) the other way.
    """
    if photometric != "RGB" or len(getattr(image, "layer", [])) != 3:
        return False
    info = getattr(image, "info", {})
    if "jfif" in info or "adobe" in info:
        return False
    return [layer[0] for layer in getattr(image, "layer", [])] != [ord(c) for c in "RGB"]


class DicomReader:
    """A :class:`~hyfi_imaging.io.base.SlideReader` over a DICOM whole-slide series.

    Args:
        path: any instance of the series (the folder is searched for the rest).
        mpp_override: microns per level-0 pixel that win over PixelSpacing.
        memory_budget: bytes one read may take (default:
            :func:`~hyfi_imaging.io.budget.default_memory_budget`).

    Raises:
        SlideError: not a whole-slide series this reader reads (see the module docstring).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mpp_override: float | None = None,
        memory_budget: int | None = None,
    ) -> None:
        self.path = str(path)
        header = read_dicom_header(path)
        if header is None or header.sop_class != WSI_SOP_CLASS:
            raise SlideError(self.path, "not a DICOM whole-slide image", "pass a slide file")
        members = series_members(Path(path), header)
        self._levels = pyramid_levels([read_instance(p) for p, _ in members])
        self._grids = [frame_grid(inst) for inst in self._levels]
        base = self._levels[0]
        self.format = "dicom"
        self.level_dimensions = tuple(inst.size or inst.tile for inst in self._levels)
        self.level_downsamples = tuple(
            level_downsample(self.level_dimensions[0], hw) for hw in self.level_dimensions
        )
        rgb = base.samples == 3
        self.channels = 3 if rgb else 1
        self.dtype: np.dtype[np.generic] = np.dtype(np.uint8 if base.bits == 8 else np.uint16)
        self.channel_names, self.channel_colors = default_channels(self.channels, rgb=rgb)
        self.background: float = default_background(self.dtype, rgb=rgb)
        self.mpp: float | None
        if mpp_override is not None:
            self.mpp, self.mpp_source = float(mpp_override), "override"
        elif base.spacing_mm is not None:
            rows, cols = base.spacing_mm  # PixelSpacing: between rows (y), then columns (x)
            self.mpp = square_mpp(self.path, 1000 * cols, 1000 * rows)
            self.mpp_source = "vendor"
        else:
            self.mpp, self.mpp_source = None, "none"
        self.memory_budget = (
            default_memory_budget() if memory_budget is None else int(memory_budget)
        )
        for level, inst in enumerate(self._levels):
            check_decodable(inst)
            if (inst.samples, inst.bits) != (base.samples, base.bits):
                raise SlideError(
                    inst.path,
                    f"level {level} has {inst.samples} x {inst.bits}-bit samples, "
                    f"level 0 {base.samples} x {base.bits}-bit",
                    _FIX,
                )
            check_need(
                inst.path,
                f"decoding one frame ({inst.tile[0]} x {inst.tile[1]} px) of "
                f"{declared(self, level)}",
                2 * self._tile_bytes(level),
                self.memory_budget,
            )
        self._files = [open(inst.path, "rb") for inst in self._levels]  # noqa: SIM115

    @property
    def level_count(self) -> int:
        return len(self._levels)

    def _tile_bytes(self, level: int) -> int:
        th, tw = self._levels[level].tile
        return self.channels * self.dtype.itemsize * th * tw

    def _tile(self, level: int, frame: int) -> np.ndarray:
        """Frame ``frame`` of ``level`` decoded as ``(C, th, tw)``."""
        inst, f = self._levels[level], self._files[level]
        data = b"".join(os.pread(f.fileno(), n, offset) for offset, n in inst.frames[frame])
        (th, tw), c = inst.tile, self.channels
        if inst.syntax in _NATIVE:
            flat = np.frombuffer(data, dtype=self.dtype.newbyteorder("<"), count=c * th * tw)
            flat = flat.astype(self.dtype, copy=False)
            if inst.planar == 1 or c == 1:  # colour by plane
                return flat.reshape(c, th, tw)
            return np.moveaxis(flat.reshape(th, tw, c), -1, 0)
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            if _jpeg_needs_raw(image, inst.photometric):
                image.draft("YCbCr", image.size)  # libjpeg's raw components: R, G, B here
            decoded = np.asarray(
                image.convert("RGB") if c == 3 and image.mode != "YCbCr" else image
            )
        decoded = decoded.reshape(decoded.shape[0], decoded.shape[1], -1)
        if decoded.shape != (th, tw, c):
            raise SlideError(
                inst.path,
                f"frame {frame + 1} decodes to {decoded.shape}, the header says {(th, tw, c)}",
                "the file may be corrupt; re-export it",
            )
        return np.moveaxis(decoded.astype(self.dtype, copy=False), -1, 0)

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Read ``[y, y+h) x [x, x+w)`` of ``level`` (level pixels) as ``(C, h, w)``."""

        def fetch(y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
            th, tw = self._levels[level].tile
            out = np.full((self.channels, y1 - y0, x1 - x0), self.background, self.dtype)
            for ty in range(y0 // th, (y1 - 1) // th + 1):
                for tx in range(x0 // tw, (x1 - 1) // tw + 1):
                    frame = self._grids[level].get((ty, tx))
                    if frame is None:
                        continue  # a tile the sparse file leaves out: background
                    tile = self._tile(level, frame)
                    ys, xs = max(y0, ty * th), max(x0, tx * tw)
                    ye, xe = min(y1, (ty + 1) * th), min(x1, (tx + 1) * tw)
                    out[:, ys - y0 : ye - y0, xs - x0 : xe - x0] = tile[
                        :, ys - ty * th : ye - ty * th, xs - tx * tw : xe - tx * tw
                    ]
            return out

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
            decoded=lambda box: 2 * self._tile_bytes(level),
        )

    def close(self) -> None:
        """Close the series' files."""
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> DicomReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""One instance (file) of a DICOM whole-slide series: its attributes and where its frames lie.

Why apart from the reader: which instances are pyramid levels, and where each
tile is, are decided from these few attributes alone (the total pixel matrix,
the frame size, the per-frame positions, the fragments of the pixel data);
parsing them is DICOM bookkeeping, deciding from them is the reader's job
(:mod:`hyfi_imaging.io.dicom_reader`). The file is mapped, walked up to its
Pixel Data with :func:`~hyfi_imaging.io.dicom.parse_dataset`, and the byte
ranges of every frame are taken from the item headers of encapsulated pixel
data (one fragment per frame, else the basic or extended offset table) or
from the frame size of native pixel data. No pixel is read.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.dicom import (
    IMPLICIT_LE,
    PIXEL_DATA,
    UNDEFINED,
    Dataset,
    DicomHeader,
    Truncated,
    dataset_start,
    element_at,
    parse_dataset,
    read_dicom_header,
    text_of,
)

__all__ = ["DicomInstance", "read_instance", "series_members"]

# Tags read (group, element).
_SOP_UID, _IMAGE_TYPE = (0x0008, 0x0018), (0x0008, 0x0008)
_ORGANIZATION = (0x0020, 0x9311)
_SAMPLES, _PHOTOMETRIC_TAG, _PLANAR = (0x0028, 0x0002), (0x0028, 0x0004), (0x0028, 0x0006)
_FRAMES, _ROWS, _COLUMNS, _BITS = (
    (0x0028, 0x0008),
    (0x0028, 0x0010),
    (0x0028, 0x0011),
    (0x0028, 0x0100),
)
_PIXEL_SPACING, _PIXEL_MEASURES = (0x0028, 0x0030), (0x0028, 0x9110)
_IMAGED_WIDTH = (0x0048, 0x0001)
_TOTAL_COLUMNS, _TOTAL_ROWS = (0x0048, 0x0006), (0x0048, 0x0007)
_PLANE_POSITION = (0x0048, 0x021A)
_COLUMN_POSITION, _ROW_POSITION = (0x0048, 0x021E), (0x0048, 0x021F)
_OPTICAL_PATHS, _FOCAL_PLANES = (0x0048, 0x0302), (0x0048, 0x0303)
_SHARED_GROUPS, _PER_FRAME_GROUPS = (0x5200, 0x9229), (0x5200, 0x9230)
_OFFSET_TABLE = (0x7FE0, 0x0001)


@dataclass(frozen=True)
class DicomInstance:
    """One instance (file) of a whole-slide series: what the reader needs, read at open.

    ``size`` is the total pixel matrix ``(rows, columns)`` (``None``: the
    instance has none, so it is a single image, not a level); ``tile`` is one
    frame's ``(rows, columns)``; ``positions`` the top-left ``(row, column)``
    of each frame in the total pixel matrix (0-based), when the file lists
    them; ``frames`` the byte ranges ``(offset, length)`` of each frame;
    ``optical_paths`` and ``focal_planes`` the instance's NumberOfOpticalPaths and
    TotalPixelMatrixFocalPlanes (``planes`` their product).
    """

    path: Path
    uid: str
    image_type: tuple[str, ...] | None
    size: tuple[int, int] | None
    tile: tuple[int, int]
    samples: int
    photometric: str
    bits: int
    planar: int
    syntax: str
    spacing_mm: tuple[float, float] | None
    organization: str | None
    planes: int
    positions: tuple[tuple[int, int], ...] | None
    frames: tuple[tuple[tuple[int, int], ...], ...]
    optical_paths: int = 1
    focal_planes: int = 1

    @property
    def flavor(self) -> str | None:
        """ImageType value 3 (``VOLUME``, ``LABEL``, ``OVERVIEW``, ...), if the file says."""
        return self.image_type[2] if self.image_type and len(self.image_type) > 2 else None


def _value(ds: Dataset, tag: tuple[int, int]) -> bytes | None:
    v = ds.get(tag)
    return v if isinstance(v, bytes) else None


def _item(ds: Dataset, *path: tuple[int, int]) -> Dataset | None:
    """The first item at the end of a path of sequences, or ``None``."""
    for tag in path:
        items = ds.get(tag)
        if not isinstance(items, list) or not items:
            return None
        ds = items[0]
    return ds


def _uint(ds: Dataset, tag: tuple[int, int], fmt: str) -> int | None:
    raw = _value(ds, tag)
    return struct.unpack_from(fmt, raw)[0] if raw and len(raw) >= struct.calcsize(fmt) else None


def _number(ds: Dataset, tag: tuple[int, int]) -> int | None:
    """An IS (integer string) value."""
    raw = _value(ds, tag)
    text = text_of(raw) if raw else ""
    return int(text) if text.lstrip("+-").isdigit() else None


def _spacing(ds: Dataset, size: tuple[int, int] | None) -> tuple[float, float] | None:
    """Pixel spacing in mm ``(row, column)``: shared functional groups, top level, or imaged width."""
    for where in (_item(ds, _SHARED_GROUPS, _PIXEL_MEASURES), ds):
        raw = _value(where, _PIXEL_SPACING) if where is not None else None
        try:
            values = [float(v) for v in text_of(raw).split("\\")] if raw else []
        except ValueError:
            values = []
        if len(values) == 2 and min(values) > 0:
            return values[0], values[1]
    width = _value(ds, _IMAGED_WIDTH)
    if width and len(width) >= 4 and size is not None and size[1] > 0:
        mm = struct.unpack_from("<f", width)[0] / size[1]
        return (mm, mm) if mm > 0 else None
    return None


def _positions(ds: Dataset) -> tuple[tuple[int, int], ...] | None:
    """Each frame's 0-based ``(row, column)`` from the per-frame Plane Position (Slide)."""
    groups = ds.get(_PER_FRAME_GROUPS)
    if not isinstance(groups, list) or not groups:
        return None
    out = []
    for group in groups:
        plane = _item(group, _PLANE_POSITION)
        row = _uint(plane, _ROW_POSITION, "<i") if plane is not None else None
        col = _uint(plane, _COLUMN_POSITION, "<i") if plane is not None else None
        if row is None or col is None:
            return None
        out.append((row - 1, col - 1))
    return tuple(out)


def _fragments(
    buf: mmap.mmap, pos: int, path: Path
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The basic offset table and ``(item position, value offset, length)`` of each fragment."""
    table: list[int] | None = None
    fragments: list[tuple[int, int, int]] = []
    while True:
        group, elem, _, start, length = element_at(buf, pos, explicit=False)
        if (group, elem) == (0xFFFE, 0xE0DD):
            return table or [], fragments
        if (group, elem) != (0xFFFE, 0xE000) or length == UNDEFINED or start + length > len(buf):
            raise SlideError(
                path,
                f"the encapsulated pixel data breaks off at byte {pos} of {len(buf)}",
                "the file may be truncated; re-copy or re-export it",
            )
        if table is None:
            table = list(struct.unpack_from(f"<{length // 4}I", buf, start))
        else:
            fragments.append((pos, start, length))
        pos = start + length


def _frame_ranges(
    buf: mmap.mmap, ds: Dataset, start: int, length: int, count: int, frame_bytes: int, path: Path
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Byte ranges of each frame, from the Pixel Data value at ``start`` of ``length``."""
    if length != UNDEFINED:  # native: frames one after another
        if start + count * frame_bytes > len(buf):
            raise SlideError(
                path,
                f"the pixel data of {count} frames needs {count * frame_bytes} bytes, the file "
                f"holds {len(buf) - start}",
                "the file may be truncated; re-copy or re-export it",
            )
        return tuple(((start + i * frame_bytes, frame_bytes),) for i in range(count))
    table, fragments = _fragments(buf, start, path)
    if len(fragments) == count:
        return tuple(((s, n),) for _, s, n in fragments)
    offsets = _value(ds, _OFFSET_TABLE)
    if offsets:
        table = list(struct.unpack(f"<{len(offsets) // 8}Q", offsets))
    if count == 1 and fragments:
        return (tuple((s, n) for _, s, n in fragments),)
    if len(table) != count:
        raise SlideError(
            path,
            f"{len(fragments)} pixel data fragments for {count} frames and no offset table",
            "re-export the slide with one fragment per frame, or convert it to TIFF",
        )
    first = fragments[0][0] if fragments else 0
    bounds = [*table, math.inf]
    return tuple(
        tuple((s, n) for item, s, n in fragments if bounds[i] <= item - first < bounds[i + 1])
        for i in range(count)
    )


def read_instance(path: Path) -> DicomInstance:
    """Parse one whole-slide instance up to its pixel data and index its frames (no pixels read).

    Whether its pixels can be decoded is :func:`check_decodable`'s question,
    asked of the levels only (a label in another syntax does not matter).

    Raises:
        SlideError: the data set cannot be walked (deflated or big-endian, cut
            short) or its frames are not where the header says.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, pos = dataset_start(buf)
        syntax = meta.get(0x0010, "")
        explicit = syntax != IMPLICIT_LE
        ds: Dataset = {}
        try:
            pos = parse_dataset(buf, pos, explicit, ds, until=PIXEL_DATA)
            at_pixels = element_at(buf, pos, explicit)[:2] == PIXEL_DATA
        except Truncated:
            at_pixels = False
        if not at_pixels:
            raise SlideError(
                path,
                f"the DICOM data set (transfer syntax {syntax or 'not stated'}) cannot be walked "
                "to its pixel data",
                "the file may be truncated or deflated; re-copy or re-export it",
            )
        rows, cols = _uint(ds, _ROWS, "<H") or 0, _uint(ds, _COLUMNS, "<H") or 0
        samples, bits = _uint(ds, _SAMPLES, "<H") or 1, _uint(ds, _BITS, "<H") or 8
        total_rows, total_cols = _uint(ds, _TOTAL_ROWS, "<I"), _uint(ds, _TOTAL_COLUMNS, "<I")
        size = (total_rows, total_cols) if total_rows and total_cols else None
        count = _number(ds, _FRAMES) or 1
        image_type = _value(ds, _IMAGE_TYPE)
        optical_paths = _uint(ds, _OPTICAL_PATHS, "<I") or 1
        focal_planes = _uint(ds, _FOCAL_PLANES, "<I") or 1
        _, _, _, start, length = element_at(buf, pos, explicit)
        return DicomInstance(
            path=path,
            uid=text_of(_value(ds, _SOP_UID) or b"") or str(path),
            image_type=tuple(text_of(image_type).split("\\")) if image_type else None,
            size=size,
            tile=(rows, cols),
            samples=samples,
            photometric=text_of(_value(ds, _PHOTOMETRIC_TAG) or b""),
            bits=bits,
            planar=_uint(ds, _PLANAR, "<H") or 0,
            syntax=syntax,
            spacing_mm=_spacing(ds, size),
            organization=text_of(_value(ds, _ORGANIZATION) or b"") or None,
            planes=focal_planes * optical_paths,
            positions=_positions(ds),
            frames=_frame_ranges(
                buf, ds, start, length, count, rows * cols * samples * bits // 8, path
            ),
            optical_paths=optical_paths,
            focal_planes=focal_planes,
        )


def series_members(path: Path, header: DicomHeader) -> list[tuple[Path, DicomHeader]]:
    """The whole-slide instances of ``path``'s series in its folder (``path`` itself included)."""
    members = [(path, header)]
    if header.series_uid is None:
        return members
    for entry in sorted(os.scandir(path.parent), key=lambda e: e.name):
        other = Path(entry.path)
        if entry.name.startswith(".") or not entry.is_file() or other.samefile(path):
            continue
        try:
            found = read_dicom_header(other)
        except OSError:
            continue
        if found is not None and found.is_wsi and found.series_uid == header.series_uid:
            members.append((other, found))
    return members

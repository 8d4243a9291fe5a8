"""Write small, real DICOM Part 10 files: whole-slide image levels and a CT slice.

Why by hand: pydicom is not a dependency, and the files only need the
attributes OpenSlide 4 and :class:`~hyfi_imaging.io.dicom_reader.DicomReader`
read (VL Whole Slide Microscopy Image Storage, TILED_FULL or per-frame plane
positions, uncompressed or JPEG frames, pixel spacing in the shared
functional groups). Explicit VR little endian unless ``implicit``; the file
meta group is explicit, as the standard has it. The layout was checked once
against pydicom 3 (it reads these files' attributes and frames back equal).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from hyfi_imaging.io.dicom import WSI_SOP_CLASS

__all__ = ["CT_SOP_CLASS", "VOLUME", "jpeg_frame", "write_ct_slice", "write_wsi_level"]

CT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.2"
#: The ImageType of a pyramid level written by a converter.
VOLUME = "DERIVED\\PRIMARY\\VOLUME\\NONE"
_EXPLICIT_LE = "1.2.840.10008.1.2.1"
_IMPLICIT_LE = "1.2.840.10008.1.2"
_JPEG_BASELINE = "1.2.840.10008.1.2.4.50"
_LONG = {"OB", "OW", "SQ", "UN", "UT"}
_UNDEFINED = 0xFFFFFFFF


@dataclass(frozen=True)
class _Encoder:
    """Elements in explicit or implicit VR little endian."""

    implicit: bool = False

    def element(self, group: int, elem: int, vr: str, value: bytes) -> bytes:
        if len(value) % 2:
            value += b"\x00" if vr in ("UI", "OB") else b" "
        tag = struct.pack("<HH", group, elem)
        if self.implicit:
            return tag + struct.pack("<I", len(value)) + value
        if vr in _LONG:
            return tag + vr.encode() + b"\x00\x00" + struct.pack("<I", len(value)) + value
        return tag + vr.encode() + struct.pack("<H", len(value)) + value

    def text(self, group: int, elem: int, vr: str, value: str) -> bytes:
        return self.element(group, elem, vr, value.encode())

    def us(self, group: int, elem: int, value: int) -> bytes:
        return self.element(group, elem, "US", struct.pack("<H", value))

    def ul(self, group: int, elem: int, value: int) -> bytes:
        return self.element(group, elem, "UL", struct.pack("<I", value))

    def sl(self, group: int, elem: int, value: int) -> bytes:
        return self.element(group, elem, "SL", struct.pack("<i", value))

    def sequence(self, group: int, elem: int, *items: bytes) -> bytes:
        body = b"".join(struct.pack("<HHI", 0xFFFE, 0xE000, len(i)) + i for i in items)
        return self.element(group, elem, "SQ", body)

    def undefined_sequence(self, group: int, elem: int, *items: bytes) -> bytes:
        """A sequence of undefined length whose items have undefined length too."""
        body = b"".join(
            struct.pack("<HHI", 0xFFFE, 0xE000, _UNDEFINED)
            + i
            + struct.pack("<HHI", 0xFFFE, 0xE00D, 0)
            for i in items
        )
        vr = b"" if self.implicit else b"SQ\x00\x00"
        head = struct.pack("<HH", group, elem) + vr + struct.pack("<I", _UNDEFINED)
        return head + body + struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)

    def encapsulated(self, frames: list[bytes]) -> bytes:
        """Pixel Data of undefined length: an empty basic offset table, one fragment per frame."""
        vr = b"" if self.implicit else b"OB\x00\x00"
        out = [struct.pack("<HH", 0x7FE0, 0x0010) + vr + struct.pack("<I", _UNDEFINED)]
        out.append(struct.pack("<HHI", 0xFFFE, 0xE000, 0))
        for frame in frames:
            frame += b"\x00" * (len(frame) % 2)
            out.append(struct.pack("<HHI", 0xFFFE, 0xE000, len(frame)) + frame)
        out.append(struct.pack("<HHI", 0xFFFE, 0xE0DD, 0))
        return b"".join(out)


_EXPLICIT = _Encoder()


def _part10(path: Path, sop_class: str, instance: str, syntax: str, dataset: bytes) -> Path:
    e = _EXPLICIT
    meta = b"".join(
        [
            e.element(0x0002, 0x0001, "OB", b"\x00\x01"),
            e.text(0x0002, 0x0002, "UI", sop_class),
            e.text(0x0002, 0x0003, "UI", instance),
            e.text(0x0002, 0x0010, "UI", syntax),
            e.text(0x0002, 0x0012, "UI", "1.2.3.4.5"),
        ]
    )
    path.write_bytes(b"\x00" * 128 + b"DICM" + e.ul(0x0002, 0x0000, len(meta)) + meta + dataset)
    return path


def jpeg_frame(tile: np.ndarray, *, rgb: bool = False) -> bytes:
    """One ``(h, w, 3)`` uint8 tile as a baseline JPEG (quality 90), as the writer stores it.

    ``rgb``: the components are R, G, B (no colour transform, no subsampling)
    and the stream carries neither a JFIF nor an Adobe marker and numbers its
    components 1, 2, 3, as in frames taken over from Aperio files: only the
    DICOM header's photometric RGB says what they are.
    """
    buf = io.BytesIO()
    if not rgb:
        Image.fromarray(tile).save(buf, format="JPEG", quality=90)
        return buf.getvalue()
    Image.fromarray(tile).save(buf, format="JPEG", quality=90, keep_rgb=True, subsampling=0)
    data, out, pos = buf.getvalue(), bytearray(b"\xff\xd8"), 2
    while pos < len(data):
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2 : pos + 4], "big")
        segment = bytearray(data[pos : pos + 2 + length])
        pos += 2 + length
        if marker in (0xE0, 0xEE):  # JFIF, Adobe
            continue
        if marker == 0xC0:  # frame header: component ids
            for k in range(segment[9]):
                segment[10 + 3 * k] = k + 1
        if marker == 0xDA:  # scan header: the same ids, then the entropy-coded data
            for k in range(segment[4]):
                segment[5 + 2 * k] = k + 1
            return bytes(out + segment + data[pos:])
        out += segment
    raise ValueError("no scan in the JPEG stream")


def write_wsi_level(
    path: Path,
    image: np.ndarray,
    *,
    series: str,
    instance: str,
    mpp: float,
    tile: int | tuple[int, int] = 256,
    referenced_series: str | None = None,
    image_type: str | None = VOLUME,
    implicit: bool = False,
    compression: str = "none",
    positions: bool = False,
    organization: str | None = "TILED_FULL",
    total_matrix: bool = True,
    optical_paths: int = 1,
    shift: tuple[int, int] = (0, 0),
) -> Path:
    """One pyramid level of a whole-slide image series: ``(h, w, 3)`` uint8 RGB or ``(h, w)`` uint16.

    ``tile`` is ``(rows, columns)`` of a frame (or one side). ``referenced_series``
    adds a Referenced Series Sequence of undefined length (before the file's own
    series UID) that names another series, as scanners do. ``image_type=None``
    leaves ImageType out; ``implicit`` writes the data set in implicit VR;
    ``compression="jpeg"`` stores baseline JPEG frames (:func:`jpeg_frame`,
    RGB images only; ``"jpeg-rgb"``: RGB-coded ones without markers); ``positions`` adds each frame's Plane Position (Slide) in the
    per-frame functional groups; ``organization=None`` leaves
    DimensionOrganizationType out; ``total_matrix=False`` leaves
    TotalPixelMatrixRows/Columns out (a single-image instance). ``optical_paths > 1``
    states NumberOfOpticalPaths and stores every tile once per path (path ``k > 0``: the
    tile inverted, ``255 - tile``, or halved if grey), path after path; ``shift``
    ``(rows, columns)`` moves every frame's plane position (with ``positions``).
    """
    e = _Encoder(implicit)
    th, tw = (tile, tile) if isinstance(tile, int) else tile
    h, w = image.shape[:2]
    gy, gx = -(-h // th), -(-w // tw)
    grey = image.ndim == 2
    samples = 1 if grey else 3
    fill = 0 if grey else 255
    padded = np.full((gy * th, gx * tw, samples), fill, image.dtype)
    padded[:h, :w] = image.reshape(h, w, samples)
    tiles = (
        padded.reshape(gy, th, gx, tw, samples)
        .transpose(0, 2, 1, 3, 4)
        .reshape(-1, th, tw, samples)
    )
    if optical_paths > 1:
        other = tiles // 2 if grey else 255 - tiles
        tiles = np.concatenate([tiles] + [other] * (optical_paths - 1))
    frames = len(tiles)
    if compression in ("jpeg", "jpeg-rgb"):
        rgb = compression == "jpeg-rgb"
        pixels = e.encapsulated([jpeg_frame(t, rgb=rgb) for t in tiles])
        syntax, photometric = _JPEG_BASELINE, "RGB" if rgb else "YBR_FULL_422"
    else:
        vr = "OW" if image.dtype == np.uint16 else "OB"
        pixels = e.element(
            0x7FE0, 0x0010, vr, tiles.astype(image.dtype.newbyteorder("<")).tobytes()
        )
        syntax = _IMPLICIT_LE if implicit else _EXPLICIT_LE
        photometric = "MONOCHROME2" if grey else "RGB"
    bits = 8 * image.dtype.itemsize
    spacing = f"{mpp / 1000:.6g}\\{mpp / 1000:.6g}"
    pixel_measures = e.sequence(0x0028, 0x9110, e.text(0x0028, 0x0030, "DS", spacing))
    per_frame = e.sequence(
        0x5200,
        0x9230,
        *(
            e.sequence(
                0x0048,
                0x021A,
                e.sl(0x0048, 0x021E, 1 + shift[1] + (i % gx) * tw)
                + e.sl(0x0048, 0x021F, 1 + shift[0] + (i // gx % gy) * th),
            )
            for i in range(frames)
        ),
    )
    dataset = b"".join(
        [
            e.text(0x0008, 0x0008, "CS", image_type) if image_type else b"",
            e.text(0x0008, 0x0016, "UI", WSI_SOP_CLASS),
            e.text(0x0008, 0x0018, "UI", instance),
            e.text(0x0008, 0x0060, "CS", "SM"),
            (
                e.undefined_sequence(
                    0x0008, 0x1115, e.text(0x0020, 0x000E, "UI", referenced_series)
                )
                if referenced_series
                else b""
            ),
            e.text(0x0020, 0x000D, "UI", series + ".9"),
            e.text(0x0020, 0x000E, "UI", series),
            e.text(0x0020, 0x9311, "CS", organization) if organization else b"",
            e.us(0x0028, 0x0002, samples),
            e.text(0x0028, 0x0004, "CS", photometric),
            e.us(0x0028, 0x0006, 0) if not grey else b"",
            e.text(0x0028, 0x0008, "IS", str(frames)),
            e.us(0x0028, 0x0010, th),
            e.us(0x0028, 0x0011, tw),
            e.us(0x0028, 0x0100, bits),
            e.us(0x0028, 0x0101, bits),
            e.us(0x0028, 0x0102, bits - 1),
            e.us(0x0028, 0x0103, 0),
            e.ul(0x0048, 0x0006, w) if total_matrix else b"",
            e.ul(0x0048, 0x0007, h) if total_matrix else b"",
            e.ul(0x0048, 0x0302, optical_paths) if optical_paths > 1 else b"",
            e.sequence(0x5200, 0x9229, pixel_measures),
            per_frame if positions else b"",
            pixels,
        ]
    )
    return _part10(path, WSI_SOP_CLASS, instance, syntax, dataset)


def write_ct_slice(path: Path, *, series: str = "1.2.3.99") -> Path:
    """A tiny CT slice: DICOM, but not a slide."""
    e = _EXPLICIT
    dataset = b"".join(
        [
            e.text(0x0008, 0x0016, "UI", CT_SOP_CLASS),
            e.text(0x0008, 0x0018, "UI", series + ".1"),
            e.text(0x0008, 0x0060, "CS", "CT"),
            e.text(0x0020, 0x000E, "UI", series),
            e.us(0x0028, 0x0010, 2),
            e.us(0x0028, 0x0011, 2),
            e.element(0x7FE0, 0x0010, "OW", b"\x00" * 8),
        ]
    )
    return _part10(path, CT_SOP_CLASS, series + ".1", _EXPLICIT_LE, dataset)

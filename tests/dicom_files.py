"""Write small, real DICOM Part 10 files: whole-slide image levels and a CT slice.

Why by hand: pydicom is not a dependency, and the files only need the
attributes OpenSlide 4 checks (VL Whole Slide Microscopy Image Storage,
TILED_FULL, uncompressed 8-bit RGB frames, pixel spacing in the shared
functional groups). Explicit VR little endian throughout.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from hyfi_imaging.io.dicom import WSI_SOP_CLASS

__all__ = ["CT_SOP_CLASS", "write_ct_slice", "write_wsi_level"]

CT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.2"
_EXPLICIT_LE = "1.2.840.10008.1.2.1"
_LONG = {"OB", "OW", "SQ", "UN", "UT"}


def _element(group: int, elem: int, vr: str, value: bytes) -> bytes:
    if len(value) % 2:
        value += b"\x00" if vr in ("UI", "OB") else b" "
    head = struct.pack("<HH", group, elem) + vr.encode()
    if vr in _LONG:
        return head + b"\x00\x00" + struct.pack("<I", len(value)) + value
    return head + struct.pack("<H", len(value)) + value


def _text(group: int, elem: int, vr: str, value: str) -> bytes:
    return _element(group, elem, vr, value.encode())


def _us(group: int, elem: int, value: int) -> bytes:
    return _element(group, elem, "US", struct.pack("<H", value))


def _ul(group: int, elem: int, value: int) -> bytes:
    return _element(group, elem, "UL", struct.pack("<I", value))


def _sequence(group: int, elem: int, *items: bytes) -> bytes:
    body = b"".join(struct.pack("<HHI", 0xFFFE, 0xE000, len(i)) + i for i in items)
    return _element(group, elem, "SQ", body)


def _undefined_sequence(group: int, elem: int, *items: bytes) -> bytes:
    """A sequence of undefined length whose items have undefined length too."""
    body = b"".join(
        struct.pack("<HHI", 0xFFFE, 0xE000, 0xFFFFFFFF) + i + struct.pack("<HHI", 0xFFFE, 0xE00D, 0)
        for i in items
    )
    head = struct.pack("<HH", group, elem) + b"SQ\x00\x00" + struct.pack("<I", 0xFFFFFFFF)
    return head + body + struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)


def _part10(path: Path, sop_class: str, instance: str, dataset: bytes) -> Path:
    meta = b"".join(
        [
            _element(0x0002, 0x0001, "OB", b"\x00\x01"),
            _text(0x0002, 0x0002, "UI", sop_class),
            _text(0x0002, 0x0003, "UI", instance),
            _text(0x0002, 0x0010, "UI", _EXPLICIT_LE),
            _text(0x0002, 0x0012, "UI", "1.2.3.4.5"),
        ]
    )
    path.write_bytes(b"\x00" * 128 + b"DICM" + _ul(0x0002, 0x0000, len(meta)) + meta + dataset)
    return path


def write_wsi_level(
    path: Path,
    image: np.ndarray,
    *,
    series: str,
    instance: str,
    mpp: float,
    tile: int = 256,
    referenced_series: str | None = None,
) -> Path:
    """One pyramid level (``(h, w, 3)`` uint8) of a whole-slide image series.

    ``referenced_series`` adds a Referenced Series Sequence of undefined length
    (before the file's own series UID) that names another series, as scanners do.
    """
    h, w = image.shape[:2]
    th, tw = -(-h // tile), -(-w // tile)
    padded = np.full((th * tile, tw * tile, 3), 255, np.uint8)
    padded[:h, :w] = image
    frames = padded.reshape(th, tile, tw, tile, 3).transpose(0, 2, 1, 3, 4).tobytes()
    spacing = f"{mpp / 1000:.6g}\\{mpp / 1000:.6g}"
    pixel_measures = _sequence(0x0028, 0x9110, _text(0x0028, 0x0030, "DS", spacing))
    dataset = b"".join(
        [
            _text(0x0008, 0x0008, "CS", "DERIVED\\PRIMARY\\VOLUME\\NONE"),
            _text(0x0008, 0x0016, "UI", WSI_SOP_CLASS),
            _text(0x0008, 0x0018, "UI", instance),
            _text(0x0008, 0x0060, "CS", "SM"),
            (
                _undefined_sequence(0x0008, 0x1115, _text(0x0020, 0x000E, "UI", referenced_series))
                if referenced_series
                else b""
            ),
            _text(0x0020, 0x000D, "UI", series + ".9"),
            _text(0x0020, 0x000E, "UI", series),
            _text(0x0020, 0x9311, "CS", "TILED_FULL"),
            _us(0x0028, 0x0002, 3),
            _text(0x0028, 0x0004, "CS", "RGB"),
            _us(0x0028, 0x0006, 0),
            _text(0x0028, 0x0008, "IS", str(th * tw)),
            _us(0x0028, 0x0010, tile),
            _us(0x0028, 0x0011, tile),
            _us(0x0028, 0x0100, 8),
            _us(0x0028, 0x0101, 8),
            _us(0x0028, 0x0102, 7),
            _us(0x0028, 0x0103, 0),
            _ul(0x0048, 0x0006, w),
            _ul(0x0048, 0x0007, h),
            _sequence(0x5200, 0x9229, pixel_measures),
            _element(0x7FE0, 0x0010, "OB", frames),
        ]
    )
    return _part10(path, WSI_SOP_CLASS, instance, dataset)


def write_ct_slice(path: Path, *, series: str = "1.2.3.99") -> Path:
    """A tiny CT slice: DICOM, but not a slide."""
    dataset = b"".join(
        [
            _text(0x0008, 0x0016, "UI", CT_SOP_CLASS),
            _text(0x0008, 0x0018, "UI", series + ".1"),
            _text(0x0008, 0x0060, "CS", "CT"),
            _text(0x0020, 0x000E, "UI", series),
            _us(0x0028, 0x0010, 2),
            _us(0x0028, 0x0011, 2),
            _element(0x7FE0, 0x0010, "OW", b"\x00" * 8),
        ]
    )
    return _part10(path, CT_SOP_CLASS, series + ".1", dataset)

"""Just enough of a DICOM Part 10 header to tell a whole-slide image from the rest.

Why our own reader and not pydicom: discovery looks at every file of a folder
and needs three values only: the SOP class (is it a whole-slide image at all,
or a CT slice?), the transfer syntax, and the series UID. A whole-slide image
is a *series* of files, one per pyramid level plus label and overview, and
OpenSlide opens the whole series from any one of them, so the series UID is
what tells discovery that five ``.dcm`` files are one slide. The file meta
group is always explicit-VR little endian; the data set is walked element by
element (explicit or implicit VR, sequences of defined or undefined length)
until the series UID ``(0020,000E)`` has passed. Pixels are never read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = ["SOP_CLASS_NAMES", "WSI_SOP_CLASS", "DicomHeader", "read_dicom_header"]

#: Media Storage SOP Class UID of "VL Whole Slide Microscopy Image Storage".
WSI_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.6"

_IMPLICIT_LE = "1.2.840.10008.1.2"
_UNREADABLE_SYNTAXES = ("1.2.840.10008.1.2.2", "1.2.840.10008.1.2.1.99")  # big endian, deflate
_LONG_VRS = {
    b"OB",
    b"OD",
    b"OF",
    b"OL",
    b"OV",
    b"OW",
    b"SQ",
    b"SV",
    b"UC",
    b"UN",
    b"UR",
    b"UT",
    b"UV",
}
_SERIES_UID = (0x0020, 0x000E)
_ITEM, _ITEM_END, _SEQ_END = 0xE000, 0xE00D, 0xE0DD
_UNDEFINED = 0xFFFFFFFF
_HEAD_BYTES = 1 << 20  # the series UID comes long before any pixel data

#: Names of SOP classes a slide folder may hold besides whole-slide images.
SOP_CLASS_NAMES = {
    WSI_SOP_CLASS: "whole-slide image",
    "1.2.840.10008.5.1.4.1.1.2": "CT image",
    "1.2.840.10008.5.1.4.1.1.4": "MR image",
    "1.2.840.10008.5.1.4.1.1.7": "secondary capture image",
    "1.2.840.10008.5.1.4.1.1.77.1.2": "VL microscopic image",
    "1.2.840.10008.5.1.4.1.1.77.1.3": "VL slide-coordinates microscopic image",
    "1.2.840.10008.5.1.4.1.1.66.4": "segmentation",
    "1.2.840.10008.5.1.4.1.1.88.33": "comprehensive SR document",
    "1.2.840.10008.5.1.4.1.1.104.1": "encapsulated PDF",
}


@dataclass(frozen=True)
class DicomHeader:
    """What discovery needs from a DICOM file; ``None`` where the header does not say."""

    sop_class: str | None
    transfer_syntax: str | None
    series_uid: str | None

    @property
    def is_wsi(self) -> bool:
        return self.sop_class == WSI_SOP_CLASS

    @property
    def kind(self) -> str:
        """The SOP class in words, e.g. ``"CT image"``."""
        if self.sop_class is None:
            return "object of unknown class"
        return SOP_CLASS_NAMES.get(self.sop_class, f"object of SOP class {self.sop_class}")


class _Truncated(Exception):
    """The header ran past the bytes read."""


def _text(value: bytes) -> str:
    return value.decode("ascii", "replace").rstrip("\x00 ").strip()


def _element(buf: bytes, pos: int, explicit: bool) -> tuple[int, int, bytes | None, int, int]:
    """``(group, element, vr, value_start, length)`` of the element at ``pos``."""
    if pos + 8 > len(buf):
        raise _Truncated
    group, elem = struct.unpack_from("<HH", buf, pos)
    if explicit and group != 0xFFFE:
        vr = buf[pos + 4 : pos + 6]
        if vr in _LONG_VRS:
            if pos + 12 > len(buf):
                raise _Truncated
            return group, elem, vr, pos + 12, struct.unpack_from("<I", buf, pos + 8)[0]
        return group, elem, vr, pos + 8, struct.unpack_from("<H", buf, pos + 6)[0]
    return group, elem, None, pos + 8, struct.unpack_from("<I", buf, pos + 4)[0]


def _skip_undefined(buf: bytes, pos: int, explicit: bool) -> int:
    """Position after a sequence of undefined length whose items start at ``pos``."""
    while True:
        group, elem, _, start, length = _element(buf, pos, explicit=False)
        if (group, elem) == (0xFFFE, _SEQ_END):
            return start
        if (group, elem) != (0xFFFE, _ITEM):
            raise _Truncated  # not a sequence after all: give up
        if length != _UNDEFINED:
            pos = start + length
            continue
        pos = start
        while True:  # an item of undefined length: elements up to the item delimiter
            group, elem, _, start, length = _element(buf, pos, explicit)
            if (group, elem) == (0xFFFE, _ITEM_END):
                pos = start
                break
            pos = _skip_undefined(buf, start, explicit) if length == _UNDEFINED else start + length


def read_dicom_header(path: str | os.PathLike[str]) -> DicomHeader | None:
    """The SOP class, transfer syntax and series UID of a DICOM Part 10 file.

    Returns ``None`` when the file is not DICOM Part 10 (no ``DICM`` at byte 128).
    A value the header does not hold, or that cannot be reached (deflated or
    big-endian data sets, a header cut short), is ``None``. Never raises for
    a bad file; ``OSError`` when it cannot be read.
    """
    with open(path, "rb") as f:
        buf = f.read(_HEAD_BYTES)
    if buf[128:132] != b"DICM":
        return None
    meta: dict[int, str] = {}
    pos = 132
    try:
        while pos + 8 <= len(buf) and struct.unpack_from("<H", buf, pos)[0] == 0x0002:
            _, elem, _, start, length = _element(buf, pos, explicit=True)
            meta[elem] = _text(buf[start : start + length])
            pos = start + length
    except _Truncated:
        pass
    sop_class, syntax = meta.get(0x0002) or None, meta.get(0x0010) or None
    series: str | None = None
    if syntax not in _UNREADABLE_SYNTAXES:
        explicit = syntax != _IMPLICIT_LE
        try:
            while pos + 8 <= len(buf):
                group, elem, _, start, length = _element(buf, pos, explicit)
                if (group, elem) == _SERIES_UID:
                    series = _text(buf[start : start + length]) or None
                    break
                if (group, elem) > _SERIES_UID:
                    break
                pos = (
                    _skip_undefined(buf, start, explicit)
                    if length == _UNDEFINED
                    else start + length
                )
        except _Truncated:
            pass
    return DicomHeader(sop_class, syntax, series)

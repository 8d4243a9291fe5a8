"""Just enough of a DICOM Part 10 data set to tell a whole-slide image from the rest, and to read one.

Why our own parser and not pydicom: discovery looks at every file of a folder
and needs three values only: the SOP class (is it a whole-slide image at all,
or a CT slice?), the transfer syntax, and the series UID (plus whether the
file says its ImageType). A whole-slide image is a *series* of files, one per
pyramid level plus label and overview, and OpenSlide opens the whole series
from any one of them, so the series UID is what tells discovery that five
``.dcm`` files are one slide. The file meta group is always explicit-VR
little endian; the data set is walked element by element (explicit or
implicit VR, sequences of defined or undefined length).

The same walk, run to the pixel data, gives
:class:`~hyfi_imaging.io.dicom_reader.DicomReader` the attributes it reads a
series by (:func:`parse_dataset`): sequences are parsed into items (in
implicit VR a value that starts with an item tag is a sequence), every other
value is kept as bytes. Pixels are never read here.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass

__all__ = [
    "IMPLICIT_LE",
    "PIXEL_DATA",
    "SOP_CLASS_NAMES",
    "UNDEFINED",
    "WSI_SOP_CLASS",
    "Buffer",
    "Dataset",
    "DicomHeader",
    "Truncated",
    "dataset_start",
    "element_at",
    "parse_dataset",
    "read_dicom_header",
    "text_of",
]

#: Media Storage SOP Class UID of "VL Whole Slide Microscopy Image Storage".
WSI_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.6"

IMPLICIT_LE = "1.2.840.10008.1.2"
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
_IMAGE_TYPE = (0x0008, 0x0008)
_SERIES_UID = (0x0020, 0x000E)
#: Pixel Data: the walk for a reader stops here.
PIXEL_DATA = (0x7FE0, 0x0010)
_ITEM, _ITEM_END, _SEQ_END = 0xE000, 0xE00D, 0xE0DD
#: A length of "undefined": up to a delimiter.
UNDEFINED = 0xFFFFFFFF
_HEAD_BYTES = 1 << 20  # the series UID comes long before any pixel data

#: What a data set is parsed from: the bytes of a file's head, or the whole file mapped.
Buffer = bytes | mmap.mmap
#: A parsed data set: tag -> value bytes, or the items of a sequence.
Dataset = dict[tuple[int, int], bytes | list["Dataset"]]

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
    """What discovery needs from a DICOM file; ``None`` where the header does not say.

    ``image_type`` is the ImageType values (``("DERIVED", "PRIMARY", "VOLUME",
    "NONE")``), ``None`` when the file has no ImageType: OpenSlide then cannot
    classify it, and :class:`~hyfi_imaging.io.dicom_reader.DicomReader` reads
    the series instead.
    """

    sop_class: str | None
    transfer_syntax: str | None
    series_uid: str | None
    image_type: tuple[str, ...] | None = None

    @property
    def is_wsi(self) -> bool:
        return self.sop_class == WSI_SOP_CLASS

    @property
    def kind(self) -> str:
        """The SOP class in words, e.g. ``"CT image"``."""
        if self.sop_class is None:
            return "object of unknown class"
        return SOP_CLASS_NAMES.get(self.sop_class, f"object of SOP class {self.sop_class}")


class Truncated(Exception):
    """The data set ran past the bytes available, or is not laid out as DICOM."""


def text_of(value: bytes) -> str:
    """A text value without its padding (NUL or space)."""
    return value.decode("ascii", "replace").rstrip("\x00 ").strip()


def element_at(buf: Buffer, pos: int, explicit: bool) -> tuple[int, int, bytes | None, int, int]:
    """``(group, element, vr, value_start, length)`` of the element at ``pos``."""
    data = buf[pos : pos + 12]
    if len(data) < 8:
        raise Truncated
    group, elem = struct.unpack_from("<HH", data)
    if explicit and group != 0xFFFE:
        vr = data[4:6]
        if vr in _LONG_VRS:
            if len(data) < 12:
                raise Truncated
            return group, elem, vr, pos + 12, struct.unpack_from("<I", data, 8)[0]
        return group, elem, vr, pos + 8, struct.unpack_from("<H", data, 6)[0]
    return group, elem, None, pos + 8, struct.unpack_from("<I", data, 4)[0]


def _is_sequence(buf: Buffer, vr: bytes | None, start: int, length: int) -> bool:
    if vr == b"SQ":
        return True
    if vr is not None and vr != b"UN":
        return False
    if length == UNDEFINED:  # implicit VR (or UN): only sequences have undefined length here
        return True
    return length >= 8 and buf[start : start + 4] == b"\xfe\xff\x00\xe0"


def _items(buf: Buffer, pos: int, length: int, explicit: bool) -> tuple[list[Dataset], int]:
    """The items of a sequence whose value starts at ``pos``, and the position after it."""
    end = pos + length if length != UNDEFINED else None
    items: list[Dataset] = []
    while end is None or pos < end:
        group, elem, _, start, item_length = element_at(buf, pos, explicit=False)
        if (group, elem) == (0xFFFE, _SEQ_END):
            return items, start
        if (group, elem) != (0xFFFE, _ITEM):
            raise Truncated  # not a sequence after all
        item: Dataset = {}
        if item_length == UNDEFINED:
            pos = parse_dataset(buf, start, explicit, item, end=None, in_item=True)
        else:
            parse_dataset(buf, start, explicit, item, end=start + item_length)
            pos = start + item_length
        items.append(item)
    return items, pos


def parse_dataset(
    buf: Buffer,
    pos: int,
    explicit: bool,
    out: Dataset,
    *,
    end: int | None = None,
    until: tuple[int, int] | None = None,
    in_item: bool = False,
) -> int:
    """Walk elements from ``pos`` into ``out``; returns the position where the walk stopped.

    Stops at ``end``, before the first tag ``>= until`` (top level), after an
    item delimiter (``in_item``), or at the end of ``buf``. ``out`` keeps what
    was parsed when :class:`Truncated` is raised half-way.
    """
    limit = len(buf) if end is None else end
    while pos + 8 <= limit:
        group, elem, vr, start, length = element_at(buf, pos, explicit)
        tag = (group, elem)
        if in_item and tag == (0xFFFE, _ITEM_END):
            return start
        if until is not None and tag >= until:
            return pos
        if _is_sequence(buf, vr, start, length):
            out[tag], pos = _items(buf, start, length, explicit)
        elif length == UNDEFINED:
            raise Truncated  # only Pixel Data (stopped at by ``until``) may be undefined
        else:
            if start + length > len(buf):
                raise Truncated
            out[tag] = buf[start : start + length]
            pos = start + length
    if in_item:
        raise Truncated
    return pos


def dataset_start(buf: Buffer) -> tuple[dict[int, str], int]:
    """The file meta group (element -> text) and where the data set starts.

    ``buf`` starts at the file's first byte (the 128-byte preamble).
    """
    meta: dict[int, str] = {}
    pos = 132
    try:
        while pos + 8 <= len(buf) and struct.unpack_from("<H", buf, pos)[0] == 0x0002:
            _, elem, _, start, length = element_at(buf, pos, explicit=True)
            meta[elem] = text_of(buf[start : start + length])
            pos = start + length
    except Truncated:
        pass
    return meta, pos


def read_dicom_header(path: str | os.PathLike[str]) -> DicomHeader | None:
    """The SOP class, transfer syntax, series UID and ImageType of a DICOM Part 10 file.

    Returns ``None`` when the file is not DICOM Part 10 (no ``DICM`` at byte 128).
    A value the header does not hold, or that cannot be reached (deflated or
    big-endian data sets, a header cut short), is ``None``. Never raises for
    a bad file; ``OSError`` when it cannot be read.
    """
    with open(path, "rb") as f:
        buf = f.read(132)
        if buf[128:132] != b"DICM":
            return None
        buf += f.read(_HEAD_BYTES - 132)
    meta, pos = dataset_start(buf)
    sop_class, syntax = meta.get(0x0002) or None, meta.get(0x0010) or None
    found: Dataset = {}
    if syntax not in _UNREADABLE_SYNTAXES:
        with contextlib.suppress(Truncated):  # a header cut short keeps what it holds
            parse_dataset(
                buf, pos, syntax != IMPLICIT_LE, found, until=(_SERIES_UID[0], _SERIES_UID[1] + 1)
            )
    series, image_type = found.get(_SERIES_UID), found.get(_IMAGE_TYPE)
    return DicomHeader(
        sop_class,
        syntax,
        text_of(series) or None if isinstance(series, bytes) else None,
        tuple(text_of(image_type).split("\\")) if isinstance(image_type, bytes) else None,
    )

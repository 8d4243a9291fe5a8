"""Open any supported image by looking at its content, never its name.

Why content: slide archives are full of ``.tif`` files that are really Aperio
SVS, OME-TIFF with SubIFD pyramids that OpenSlide cannot see, or PNGs renamed
by some export tool. The file's first bytes (and, for TIFF, OpenSlide's own
vendor detection) decide the reader:

=====================================  ===============================
content                                reader
=====================================  ===============================
directory with ``zarr.json``           :class:`ZarrReader`
PNG / JPEG magic                       Pillow (:func:`open_image`)
TIFF / BigTIFF, vendor format          :class:`OpenSlideReader`
TIFF / BigTIFF, generic or OME         :class:`TiffReader` (tifffile)
DICOM whole-slide image (``DICM``)     :class:`OpenSlideReader` (OpenSlide >= 4)
DICOM WSI series without ImageType     :class:`DicomReader` (its own frame index)
DICOM WSI, grey or multi-path levels   :class:`DicomReader` (OpenSlide misreads them)
anything else OpenSlide detects        :class:`OpenSlideReader` (e.g. MRXS)
=====================================  ===============================

Other formats are recognised by their magic bytes too (JPEG 2000, GIF, BMP,
WebP, CZI, PDF, archives, DICOM objects that are not slides, ...), so that a
folder scan can say *what* a skipped file is, not only that it was skipped:
:func:`recognise` answers "can a reader here open it, and if not, why not".
An empty file is called what it is, "empty file (0 bytes)" (an interrupted
copy, usually), not content that is not recognised.

Generic TIFF goes to tifffile rather than OpenSlide because tifffile also sees
SubIFD pyramids and reads tiles through a zarr view (measured faster).
Reader modules are imported lazily so ``import hyfi_imaging`` stays cheap and
starts no zarr event loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import SlideReader

__all__ = ["FORMAT_NAMES", "Recognised", "open_slide", "recognise", "sniff_format"]

#: (offset, magic bytes, kind), first match wins.
_MAGICS: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"\xff\xd8\xff", "jpeg"),
    (0, b"II*\x00", "tiff"),
    (0, b"MM\x00*", "tiff"),
    (0, b"II+\x00", "tiff"),  # BigTIFF
    (0, b"MM\x00+", "tiff"),
    (128, b"DICM", "dicom"),
    (0, b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),
    (0, b"\xffO\xffQ", "jpeg2000"),  # raw J2K codestream
    (0, b"GIF87a", "gif"),
    (0, b"GIF89a", "gif"),
    (0, b"ZISRAWFILE", "czi"),
    (0, b"%PDF-", "pdf"),
    (0, b"PK\x03\x04", "zip"),
    (0, b"\x1f\x8b", "gzip"),
    (0, b"7z\xbc\xaf\x27\x1c", "7z"),
    (0, b"\x89HDF\r\n\x1a\n", "hdf5"),
    (0, b"SQLite format 3\x00", "sqlite"),
    (0, b"\x00\x05\x16\x07", "appledouble"),
)

#: What each :func:`sniff_format` kind is, in words.
FORMAT_NAMES = {
    "zarr": "OME-Zarr store",
    "png": "PNG image",
    "jpeg": "JPEG image",
    "tiff": "TIFF",
    "dicom": "DICOM file",
    "jpeg2000": "JPEG 2000 image",
    "gif": "GIF image",
    "bmp": "BMP image",
    "webp": "WebP image",
    "czi": "Zeiss CZI file",
    "pdf": "PDF document",
    "zip": "ZIP archive",
    "gzip": "gzip archive",
    "7z": "7-Zip archive",
    "hdf5": "HDF5 file",
    "sqlite": "SQLite database",
    "appledouble": "macOS resource fork (AppleDouble)",
    "empty": "empty file (0 bytes)",
    "other": "unrecognised content",
}

_READABLE = ("zarr", "png", "jpeg", "tiff")


def _sniff_bytes(head: bytes) -> str:
    if not head:
        return "empty"
    for offset, magic, kind in _MAGICS:
        if head[offset : offset + len(magic)] == magic:
            return kind
    if head[:2] == b"BM" and head[6:10] == b"\x00\x00\x00\x00":  # reserved bytes are zero
        return "bmp"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return "other"


def sniff_format(path: str | os.PathLike[str]) -> str:
    """Classify ``path`` by content: ``"zarr"``, ``"png"``, ``"jpeg"``, ``"tiff"``, ``"dicom"``,
    another key of :data:`FORMAT_NAMES` (recognised, no reader here; ``"empty"`` for
    0 bytes), or ``"other"``.

    Raises:
        SlideError: the path does not exist or cannot be read.
    """
    p = Path(path)
    if p.is_dir():
        if (p / "zarr.json").is_file() or (p / ".zgroup").is_file():
            return "zarr"
        raise SlideError(
            str(p),
            "directory is not a zarr store (no zarr.json)",
            "pass a slide file or an OME-Zarr store written by hyfi-preprocess",
        )
    try:
        with open(p, "rb") as f:
            head = f.read(132)
    except FileNotFoundError:
        raise SlideError(str(p), "file not found", "check the path") from None
    except OSError as err:
        raise SlideError(str(p), f"cannot read file ({err.strerror})", "check permissions") from err
    return _sniff_bytes(head)


@dataclass(frozen=True)
class Recognised:
    """What a file's content is, and whether a reader here opens it.

    Attributes:
        kind: :func:`sniff_format`'s word for the content.
        readable: :func:`open_slide` has a reader for it (it may still turn
            out damaged when opened).
        reason: why not, in words, when not readable (e.g. ``"DICOM CT
            image, not a whole-slide image"``); empty when readable.
        series: for DICOM, the series UID: the files of one series are one slide.
    """

    kind: str
    readable: bool
    reason: str = ""
    series: str | None = None


def recognise(path: str | os.PathLike[str]) -> Recognised:
    """Look at a file's content (never its name) and say whether it is an image we read.

    Cheap: a few bytes, a DICOM header, or OpenSlide's format detection (which
    reads headers only); no pixels are decoded.

    Raises:
        SlideError: the path does not exist or cannot be read.
    """
    p = Path(path)
    kind = sniff_format(p)
    if kind in _READABLE:
        return Recognised(kind, True)
    if kind == "empty":
        return Recognised(kind, False, FORMAT_NAMES[kind])
    if kind == "dicom":
        from hyfi_imaging.io.dicom import read_dicom_header

        try:
            header = read_dicom_header(p)
        except OSError as err:
            raise SlideError(
                str(p), f"cannot read file ({err.strerror})", "check permissions"
            ) from err
        if header is None or not header.is_wsi:
            what = header.kind if header is not None else "object"
            return Recognised(kind, False, f"DICOM {what}, not a whole-slide image")
        from hyfi_imaging.io.dicom_reader import READABLE_SYNTAXES

        if _openslide_vendor(p) != "dicom" and header.transfer_syntax not in READABLE_SYNTAXES:
            return Recognised(
                kind,
                False,
                "DICOM whole-slide image that OpenSlide cannot open (OpenSlide >= 4.0 reads "
                "DICOM with JPEG, JPEG 2000 or uncompressed RGB tiles)",
                header.series_uid,
            )
        return Recognised(kind, True, series=header.series_uid)
    if _openslide_vendor(p) is not None:  # MRXS, VMS/VMU, Sakura (SQLite), ...
        return Recognised(kind, True)
    if kind == "other":
        return Recognised(kind, False, "content not recognised as an image")
    return Recognised(kind, False, f"{FORMAT_NAMES[kind]}, a format hyfi-imaging does not read")


def _openslide_vendor(path: Path) -> str | None:
    try:
        import openslide

        vendor: str | None = openslide.OpenSlide.detect_format(str(path))
    except Exception:  # a damaged file makes OpenSlide raise; let tifffile report it
        return None
    return vendor


def _own_dicom_reader(path: Path, vendor: str | None) -> bool:
    """A DICOM whole-slide series OpenSlide cannot read, or would misread: it does not detect
    it, an instance lacks ImageType, or a pyramid level is not colour or holds several
    optical paths or focal planes.

    OpenSlide 4 refuses the whole series when any instance has no ImageType
    ("Couldn't get image flavor"); :class:`DicomReader` reads it by its other attributes.
    It refuses MONOCHROME2 levels ("Couldn't read PlanarConfiguration"), which
    :class:`DicomReader` reads exactly; and it reads the frames of several optical paths
    or focal planes (NumberOfOpticalPaths, TotalPixelMatrixFocalPlanes) as one tile-by-tile
    mix of them, which :class:`DicomReader` refuses in one line.
    """
    from hyfi_imaging.io.dicom import read_dicom_header
    from hyfi_imaging.io.dicom_instance import read_instance, series_members

    header = read_dicom_header(path)
    if header is None or not header.is_wsi:
        return False
    if vendor != "dicom":
        return True
    members = series_members(path, header)
    if any(h.image_type is None for _, h in members):
        return True
    for member, _ in members:
        try:
            inst = read_instance(member)
        except Exception:  # a damaged instance: OpenSlide says what is wrong with it
            continue
        if inst.size is None or inst.flavor not in (None, "VOLUME"):
            continue  # a label or overview: not read
        if inst.planes > 1 or not inst.photometric.startswith(("RGB", "YBR")):
            return True
    return False


def _check_tiff_complete(path: Path) -> None:
    import tifffile

    from hyfi_imaging.io.tiff_reader import check_complete

    try:
        with tifffile.TiffFile(path) as tif:
            check_complete(tif, str(path))
    except SlideError:
        raise
    except Exception as err:
        raise SlideError(
            str(path),
            f"the TIFF structure cannot be read ({type(err).__name__}: {err})",
            "the file may be truncated or corrupt; re-copy or re-export it",
        ) from err


def open_slide(
    path: str | os.PathLike[str],
    *,
    mpp_override: float | None = None,
    memory_budget: int | None = None,
) -> SlideReader:
    """Open a slide, image or OME-Zarr store with the reader its content calls for.

    Args:
        path: a slide file (SVS, NDPI, MRXS, TIFF, OME-TIFF, ...), a PNG or
            JPEG image, or an OME-Zarr directory.
        mpp_override: microns per level-0 pixel; when given it wins over the
            file's metadata (``mpp_source == "override"``). When neither
            exists ``mpp`` stays ``None``: hyfi-imaging never guesses.
        memory_budget: bytes one read of a TIFF, OpenSlide, PNG/JPEG or OME-Zarr image
            may take (default: :func:`~hyfi_imaging.io.budget.default_memory_budget`);
            an image that cannot be read within it is refused before decoding.
            (OME-Zarr stores are read chunk by chunk as written.)

    Raises:
        SlideError: missing file, unsupported format, corrupt or truncated file,
            a strip, tile or image too large for the memory budget.

    Example:
        >>> with open_slide("slide.svs") as slide:          # doctest: +SKIP
        ...     tile = slide.read_region(0, 1024, 2048, 512, 512)
    """
    if mpp_override is not None and not mpp_override > 0:
        raise SlideError(
            str(path), f"mpp override {mpp_override} is not positive", "pass e.g. 0.25"
        )
    p = Path(path)
    kind = sniff_format(p)
    if kind == "empty":
        raise SlideError(
            str(p), FORMAT_NAMES["empty"], "the copy or export did not finish; copy the file again"
        )
    if kind == "zarr":
        from hyfi_imaging.io.budget import default_memory_budget
        from hyfi_imaging.io.zarr_store import ZarrReader

        budget = default_memory_budget() if memory_budget is None else memory_budget
        return ZarrReader(p, mpp_override=mpp_override, memory_budget=budget)
    if kind in ("png", "jpeg"):
        from hyfi_imaging.io.image_reader import open_image

        return open_image(p, mpp_override=mpp_override, memory_budget=memory_budget)
    vendor = _openslide_vendor(p)
    if kind == "dicom" and _own_dicom_reader(p, vendor):
        from hyfi_imaging.io.dicom_reader import DicomReader

        return DicomReader(p, mpp_override=mpp_override, memory_budget=memory_budget)
    if kind == "tiff" and vendor in (None, "generic-tiff"):
        from hyfi_imaging.io.tiff_reader import TiffReader

        return TiffReader(p, mpp_override=mpp_override, memory_budget=memory_budget)
    if vendor is not None:
        from hyfi_imaging.io.openslide_reader import OpenSlideReader

        if kind == "tiff":
            _check_tiff_complete(p)

        return OpenSlideReader(p, mpp_override=mpp_override, memory_budget=memory_budget)
    what = FORMAT_NAMES.get(kind, kind) if kind != "dicom" else recognise(p).reason
    raise SlideError(
        str(p),
        f"unsupported format: {what} (hyfi-imaging reads TIFF, PNG, JPEG, OME-Zarr, "
        "DICOM whole-slide images and OpenSlide formats)",
        "convert it to TIFF or OME-Zarr",
    )

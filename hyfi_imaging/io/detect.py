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
anything else OpenSlide detects        :class:`OpenSlideReader` (e.g. MRXS)
=====================================  ===============================

Generic TIFF goes to tifffile rather than OpenSlide because tifffile also sees
SubIFD pyramids and reads tiles through a zarr view (measured faster).
Reader modules are imported lazily so ``import hyfi_imaging`` stays cheap and
starts no zarr event loop.
"""

from __future__ import annotations

import os
from pathlib import Path

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import SlideReader

__all__ = ["open_slide", "sniff_format"]

_TIFF_MAGICS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"


def sniff_format(path: str | os.PathLike[str]) -> str:
    """Classify ``path`` by content: ``"zarr"``, ``"png"``, ``"jpeg"``, ``"tiff"`` or ``"other"``.

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
            head = f.read(8)
    except FileNotFoundError:
        raise SlideError(str(p), "file not found", "check the path") from None
    except OSError as err:
        raise SlideError(str(p), f"cannot read file ({err.strerror})", "check permissions") from err
    if head.startswith(_PNG_MAGIC):
        return "png"
    if head.startswith(_JPEG_MAGIC):
        return "jpeg"
    if head[:4] in _TIFF_MAGICS:
        return "tiff"
    return "other"


def _openslide_vendor(path: Path) -> str | None:
    try:
        import openslide

        vendor: str | None = openslide.OpenSlide.detect_format(str(path))
    except Exception:  # a damaged file makes OpenSlide raise; let tifffile report it
        return None
    return vendor


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


def open_slide(path: str | os.PathLike[str], *, mpp_override: float | None = None) -> SlideReader:
    """Open a slide, image or OME-Zarr store with the reader its content calls for.

    Args:
        path: a slide file (SVS, NDPI, MRXS, TIFF, OME-TIFF, ...), a PNG or
            JPEG image, or an OME-Zarr directory.
        mpp_override: microns per level-0 pixel; when given it wins over the
            file's metadata (``mpp_source == "override"``). When neither
            exists ``mpp`` stays ``None``: hyfi-imaging never guesses.

    Raises:
        SlideError: missing file, unsupported format, corrupt or truncated file.

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
    if kind == "zarr":
        from hyfi_imaging.io.zarr_store import ZarrReader

        return ZarrReader(p, mpp_override=mpp_override)
    if kind in ("png", "jpeg"):
        from hyfi_imaging.io.image_reader import open_image

        return open_image(p, mpp_override=mpp_override)
    vendor = _openslide_vendor(p)
    if kind == "tiff" and vendor in (None, "generic-tiff"):
        from hyfi_imaging.io.tiff_reader import TiffReader

        return TiffReader(p, mpp_override=mpp_override)
    if vendor is not None:
        from hyfi_imaging.io.openslide_reader import OpenSlideReader

        if kind == "tiff":
            _check_tiff_complete(p)

        return OpenSlideReader(p, mpp_override=mpp_override)
    raise SlideError(
        str(p),
        "unsupported format (not TIFF, PNG, JPEG, OME-Zarr or an OpenSlide format)",
        "convert it to TIFF or OME-Zarr",
    )

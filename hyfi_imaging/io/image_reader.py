"""PNG and JPEG images through Pillow, served as a one-level slide.

Why a whole-image decode is fine here: PNG and JPEG carry no tiles, so any
region read decodes the whole file anyway; decoding once into an
:class:`~hyfi_imaging.io.base.ArrayReader` is the cheapest way. The size is
capped so a mislabelled giant image fails with a clear message instead of
exhausting memory (whole slides belong in TIFF or OME-Zarr). PNG physical
size (``pHYs``) and JPEG DPI are screen or print settings, not microscope
scales, so no mpp is read from them: mpp is the override or unknown.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import ArrayReader

__all__ = ["MAX_IMAGE_SIDE", "open_image"]

#: Larger PNG/JPEG images are refused (convert them to a tiled TIFF).
MAX_IMAGE_SIDE = 20000


def open_image(
    path: str | os.PathLike[str],
    *,
    mpp_override: float | None = None,
    memory_budget: int | None = None,
) -> ArrayReader:
    """Decode a PNG or JPEG into an RGB ``ArrayReader`` (format ``"png"`` / ``"jpeg"``).

    Grayscale and palette images become RGB; transparency is composited over white. A
    16-bit PNG keeps its 16 bits (grey: one intensity channel; colour: RGB), decoded by
    imagecodecs since Pillow keeps only 8 bits of colour. The EXIF orientation is applied,
    so the image is upright as a viewer shows it.
    The whole image is decoded, so its declared size is checked against
    ``memory_budget`` first (default:
    :func:`~hyfi_imaging.io.budget.default_memory_budget`).

    Raises:
        SlideError: the file is not a readable image, is truncated, is
            larger than ``MAX_IMAGE_SIDE`` on a side, or its decoding is over
            the memory budget.
    """
    from PIL import Image

    from hyfi_imaging.io.budget import check_need, default_memory_budget, read_cost

    where = str(path)
    # Pillow refuses images above 2 x MAX_IMAGE_PIXELS (179 Mpx) as decompression bombs, with
    # an error that read as a damaged file for a valid 19000^2 PNG: the limits here are our
    # own (MAX_IMAGE_SIDE, then the memory budget before anything is decoded).
    bomb_limit = Image.MAX_IMAGE_PIXELS
    if bomb_limit is not None:
        Image.MAX_IMAGE_PIXELS = max(bomb_limit, MAX_IMAGE_SIDE**2 // 2)
    try:
        with warnings.catch_warnings():
            # Pillow's decompression-bomb warning would duplicate our own size check.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(where) as img:
                w, h = img.size
                if max(h, w) > MAX_IMAGE_SIDE:
                    raise SlideError(
                        where,
                        f"image of {h}x{w} pixels is larger than {MAX_IMAGE_SIDE} on a side",
                        "convert it to a tiled pyramidal TIFF or OME-Zarr",
                    )
                # Decoded (up to RGBA), converted to RGB, copied to (C, H, W): about three
                # copies of an RGBA image, before any of it is decoded.
                check_need(
                    where,
                    f"decoding the whole image (declared {h} x {w} px, {len(img.getbands())} "
                    "channels)",
                    read_cost(4, 1, h, w, decoded=4 * h * w),
                    default_memory_budget() if memory_budget is None else memory_budget,
                )
                fmt = (img.format or "image").lower()
                orientation = _orientation(img)
                names: tuple[str, ...] | None = None
                if fmt == "png" and _png_bit_depth(where) == 16:
                    # Pillow keeps 16-bit grey only as 32-bit integers and reduces 16-bit
                    # colour to 8 bits: decoded here as stored.
                    array, names = _png16(where, "transparency" in img.info)
                else:
                    img.load()
                    if img.mode in ("L", "LA"):
                        # Grey: one intensity channel, as a 16-bit grey PNG and a grey TIFF
                        # are (made RGB, a light-background grey image went the bright-field
                        # tissue rule, which cut away faint tissue without a word); an alpha
                        # over 0, the intensity background.
                        la = np.asarray(img.convert("LA"), dtype=np.uint16)
                        grey = (la[..., 0] * la[..., 1] + 127) // 255
                        array = grey.astype(np.uint8)[..., None]
                    elif img.mode in ("RGBA", "PA") or "transparency" in img.info:
                        rgba = img.convert("RGBA")
                        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                        array = np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
                    else:
                        array = np.asarray(img.convert("RGB"))
                array = _ORIENT.get(orientation, lambda a: a)(array)
    except SlideError:
        raise
    except FileNotFoundError:
        raise SlideError(where, "file not found", "check the path") from None
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError for bad files
        raise SlideError(
            where,
            f"cannot decode image ({type(err).__name__}: {err})",
            "check that the file is a complete PNG or JPEG",
        ) from err
    finally:
        Image.MAX_IMAGE_PIXELS = bomb_limit
    return ArrayReader(
        np.ascontiguousarray(np.moveaxis(array, -1, 0)),
        path=where,
        format="jpeg" if fmt == "mpo" else fmt,
        mpp=mpp_override,
        mpp_source="override" if mpp_override is not None else "none",
        channel_names=names,
    )


#: EXIF orientation (tag 274) -> the transform that shows the image upright, on ``(H, W, C)``
#: arrays (Pillow's ``ImageOps.exif_transpose``: 5 transposes, 6 turns clockwise, 8 back).
_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.swapaxes(0, 1),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a.swapaxes(0, 1)[::-1, ::-1],
    8: lambda a: np.rot90(a, 1),
}


def _orientation(img: Any) -> int:
    """The EXIF orientation a camera or scanner wrote (1: stored upright)."""
    try:
        return int(img.getexif().get(274, 1))
    except Exception:  # a damaged EXIF block says nothing about the pixels
        return 1


def _png_bit_depth(path: str) -> int:
    """The bit depth in a PNG's header (0 for a file that does not start like a PNG)."""
    with open(path, "rb") as f:
        head = f.read(26)
    return head[24] if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR" else 0


def _png16(path: str, keyed: bool) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """A 16-bit PNG as stored, ``(H, W, C)`` uint16, and its channel names (RGB's for colour;
    None: grey, an intensity image). An alpha channel is composited over the background:
    white glass for colour, 0 for grey (:func:`~hyfi_imaging.io.pixels.default_background`)."""
    import imagecodecs

    from hyfi_imaging.io.pixels import RGB_NAMES

    if keyed:
        raise SlideError(
            path,
            "16-bit PNG with a transparent colour key (tRNS)",
            "convert it to a 16-bit TIFF, or to PNG with an alpha channel",
        )
    with open(path, "rb") as f:
        data = np.asarray(imagecodecs.png_decode(f.read()))
    if data.ndim == 2:
        data = data[..., None]
    colour = data.shape[-1] in (3, 4)
    if data.shape[-1] in (2, 4):  # unassociated alpha, composited in integers, rounded
        a = data[..., -1:].astype(np.uint64)
        back = 65535 if colour else 0
        mixed = data[..., :-1].astype(np.uint64) * a + back * (65535 - a)
        data = ((mixed + 32767) // 65535).astype(np.uint16)
    return data, RGB_NAMES if colour else None

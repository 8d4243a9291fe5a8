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

    Grayscale and palette images become RGB; transparency is composited over white.
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
                img.load()
                if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
                    rgba = img.convert("RGBA")
                    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                    rgb = Image.alpha_composite(white, rgba).convert("RGB")
                else:
                    rgb = img.convert("RGB")
                array = np.asarray(rgb)
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
    return ArrayReader(
        np.ascontiguousarray(np.moveaxis(array, -1, 0)),
        path=where,
        format="jpeg" if fmt == "mpo" else fmt,
        mpp=mpp_override,
        mpp_source="override" if mpp_override is not None else "none",
    )

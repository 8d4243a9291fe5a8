"""Slide readers behind one protocol, and the OME-Zarr writer."""

from __future__ import annotations

from hyfi_imaging.io.base import BACKGROUND, ArrayReader, SlideReader, thumbnail
from hyfi_imaging.io.detect import open_slide

__all__ = ["BACKGROUND", "ArrayReader", "SlideReader", "open_slide", "thumbnail"]

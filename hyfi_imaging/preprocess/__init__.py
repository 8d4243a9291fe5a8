"""Whole-slide preprocessing: tissue masks, slide -> OME-Zarr conversion, manifest, QC.

The names below load on first use (PEP 562): a training rank reads the manifest through
:mod:`.manifest` alone, and importing the converter (SciPy, scikit-image, the QC figures)
cost every rank about 0.25 s of start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.convert import ConvertResult, PreprocessOptions, convert_slide
    from hyfi_imaging.preprocess.manifest import ManifestRow, read_labels, read_manifest
    from hyfi_imaging.preprocess.run import PreprocessSummary, run_preprocess

#: Each public name and the module that defines it.
_HOMES = {
    "ConvertResult": "convert",
    "PreprocessOptions": "convert",
    "convert_slide": "convert",
    "ManifestRow": "manifest",
    "read_labels": "manifest",
    "read_manifest": "manifest",
    "PreprocessSummary": "run",
    "run_preprocess": "run",
}

__all__ = [
    "ConvertResult",
    "ManifestRow",
    "PreprocessOptions",
    "PreprocessSummary",
    "convert_slide",
    "read_labels",
    "read_manifest",
    "run_preprocess",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)

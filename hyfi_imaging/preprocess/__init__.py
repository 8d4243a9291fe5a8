"""Whole-slide preprocessing: tissue masks, slide -> OME-Zarr conversion, manifest, QC."""

from __future__ import annotations

from hyfi_imaging.preprocess.convert import ConvertResult, PreprocessOptions, convert_slide
from hyfi_imaging.preprocess.manifest import ManifestRow, read_labels, read_manifest
from hyfi_imaging.preprocess.run import PreprocessSummary, run_preprocess

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

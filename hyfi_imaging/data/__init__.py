"""Tiles with halos, globally consistent augmentation, and the per-rank Dataset.

Why the lazy attribute: :mod:`hyfi_imaging.data.tiles` and
:mod:`hyfi_imaging.data.augment` are numpy-only and used by tools that never
train (``hyfi-synth``, QC, tests of geometry); importing torch for them would
cost seconds per process. :class:`TileDataset` (which needs torch) is imported
on first use. Synthetic slides live in :mod:`hyfi_imaging.data.synthetic`.

Volumes have their own modules, imported by name: N-d tiling
(:mod:`~hyfi_imaging.geometry.tiles`, which :mod:`~hyfi_imaging.data.tiles` uses),
3-D augmentation (:mod:`~hyfi_imaging.data.volume_augment`), the
:class:`~hyfi_imaging.data.volume_dataset.VolumeDataset`, synthetic fields and
blobs (:mod:`~hyfi_imaging.data.volumes`) and their manifest
(:mod:`~hyfi_imaging.data.volume_manifest`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyfi_imaging.data.augment import (
    AugmentConfig,
    AugmentParams,
    apply_colour,
    apply_geometry,
    augment_image,
    draw_augment,
    output_size,
    read_augmented,
    source_box,
)
from hyfi_imaging.data.tiles import (
    Halo,
    TileRegion,
    normalize_halo,
    read_label_tile,
    read_tile,
    read_window,
    stitch,
    strip_halo,
    tile_region,
    tile_regions,
)

if TYPE_CHECKING:
    from hyfi_imaging.data.dataset import Sample, TileDataset, load_samples

__all__ = [
    "AugmentConfig",
    "AugmentParams",
    "Halo",
    "Sample",
    "TileDataset",
    "TileRegion",
    "apply_colour",
    "apply_geometry",
    "augment_image",
    "draw_augment",
    "load_samples",
    "normalize_halo",
    "output_size",
    "read_augmented",
    "read_label_tile",
    "read_tile",
    "read_window",
    "source_box",
    "stitch",
    "strip_halo",
    "tile_region",
    "tile_regions",
]

_LAZY = {"Sample", "TileDataset", "load_samples"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from hyfi_imaging.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'hyfi_imaging.data' has no attribute {name!r}")

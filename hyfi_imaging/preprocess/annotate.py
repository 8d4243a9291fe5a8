"""One slide's annotations through preprocessing: parse, label, rasterize, record.

Why a module of its own: the steps are few but they touch four others (the
file formats in :mod:`~hyfi_imaging.io.annotations`, the crop plan, the
rasterizer in :mod:`~hyfi_imaging.preprocess.rasterize`, the label writer in
:mod:`~hyfi_imaging.io.labels`), and :mod:`~hyfi_imaging.preprocess.convert`
only has to call two functions at the right moments: parse before anything
is written (a malformed file fails the slide at no cost), write after the
image, into the same temporary store, so both are renamed into place together.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyfi_imaging.io.annotations import LabelledPolygon, label_polygons, read_annotations
from hyfi_imaging.io.labels import write_label_image
from hyfi_imaging.preprocess.canvas import CropPlan
from hyfi_imaging.preprocess.rasterize import MaskRenderer

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.convert import PreprocessOptions

__all__ = ["annotation_record", "labelled_polygons", "write_annotations"]


def annotation_record(annotation: Path | None) -> dict[str, Any]:
    """What the store records of its annotation file: path and fingerprint (``None``: no file)."""
    from hyfi_imaging.preprocess.convert import source_fingerprint

    if annotation is None:
        return {"source": None, "fingerprint": None}
    return {"source": str(annotation.resolve()), "fingerprint": source_fingerprint(annotation)}


def labelled_polygons(
    annotation: Path | None, options: PreprocessOptions
) -> list[LabelledPolygon] | None:
    """The slide's labelled polygons (``[]`` without a file); ``None`` when not asked for."""
    if options.annotation_classes is None:
        return None
    if annotation is None:
        return []
    classes = dict(options.annotation_classes)
    return label_polygons(read_annotations(annotation), classes, annotation)


def write_annotations(
    store: Path,
    polygons: list[LabelledPolygon],
    plan: CropPlan,
    options: PreprocessOptions,
    annotation: Path | None,
) -> None:
    """Rasterize ``polygons`` through ``plan`` into ``store``'s ``labels/annotations``."""
    write_label_image(
        store,
        MaskRenderer(polygons, plan, options.size),
        mpp=plan.mpp,
        classes=dict(options.annotation_classes or ()),
        attrs=annotation_record(annotation),
        chunk=options.chunk,
        shard=options.shard,
        pyramid_levels=options.pyramid_levels,
    )

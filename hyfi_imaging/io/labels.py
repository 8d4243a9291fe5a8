"""Label images inside an OME-Zarr store (NGFF 0.5 ``labels``), written and read shard by shard.

Why inside the image's store, in NGFF's layout: the mask must travel with the
image it was aligned to (one atomic rename moves both, one fingerprint says
both are current), and viewers that know NGFF (napari-ome-zarr, vizarr,
QuPath's OME-Zarr reader) show it over the image without being told how::

    <slide>.zarr/                 the image (multiscales "0", "1", ...)
      labels/zarr.json            attributes.ome.labels = ["annotations"]
      labels/annotations/         a multiscale uint8 image, axes c, y, x (c = 1)
        zarr.json                 attributes.ome.multiscales + image-label
        0/, 1/, ...               the same levels, chunks and shards as the image

The pyramid is written by the image's own writer
(:func:`~hyfi_imaging.io.zarr_store.write_pyramid`), so level ``l`` of the
mask covers the same pixels as level ``l`` of the image; only the reduction
differs: a label is a category, so each coarser pixel is the *mode* of its
2x2 block (ties go to the larger label, so a thin lesion is not lost to the
background at coarse levels), never a mean. ``image-label`` gives each label
value a colour and its class names, and ``source.image`` points back at the
image (``"../../"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hyfi_imaging.io.inventory import INVENTORY_ATTR, take_inventory
from hyfi_imaging.io.zarr_store import (
    NGFF_VERSION,
    RegionSource,
    ZarrReader,
    multiscales_metadata,
    write_pyramid,
)

__all__ = [
    "LABEL_COLORS",
    "downsample_labels_2x",
    "label_names",
    "label_path",
    "open_labels",
    "write_label_image",
]

#: RGBA per label value (0 transparent); values past the list cycle through it from 1.
LABEL_COLORS: tuple[tuple[int, int, int, int], ...] = (
    (0, 0, 0, 0),
    (230, 25, 75, 160),
    (60, 180, 75, 160),
    (0, 130, 200, 160),
    (245, 130, 48, 160),
    (145, 30, 180, 160),
    (70, 240, 240, 160),
    (240, 50, 230, 160),
)


def _color(value: int) -> list[int]:
    if value == 0:
        return list(LABEL_COLORS[0])
    return list(LABEL_COLORS[1 + (value - 1) % (len(LABEL_COLORS) - 1)])


def downsample_labels_2x(labels: np.ndarray) -> np.ndarray:
    """Halve a ``(C, H, W)`` uint8 label image: each pixel the mode of its 2x2 block.

    Ties go to the larger label (two tumour pixels beside two background
    pixels stay tumour). An odd last row or column is replicated, as
    :func:`~hyfi_imaging.io.zarr_store.downsample_2x` does for images, so
    level ``l`` pixel ``i`` covers level-0 pixels ``[i·2^l, (i+1)·2^l)``.
    """
    h, w = labels.shape[1:]
    if h % 2 or w % 2:
        labels = np.pad(labels, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge")
    quads = [
        labels[:, 0::2, 0::2],
        labels[:, 1::2, 0::2],
        labels[:, 0::2, 1::2],
        labels[:, 1::2, 1::2],
    ]
    best: np.ndarray | None = None
    for q in quads:
        count = sum((q == other).astype(np.uint16) for other in quads)
        key = count * 256 + q.astype(np.uint16)  # most frequent, then largest
        best = key if best is None else np.maximum(best, key)
    assert best is not None
    return (best % 256).astype(labels.dtype)


def label_path(store: str | os.PathLike[str], name: str = "annotations") -> Path:
    """Where label image ``name`` of ``store`` lives (refused unless inside ``labels/``).

    ``name`` comes from a recipe, a volume manifest or the store's own
    ``labels`` list, so it is checked like an id (:func:`~hyfi_imaging.paths.safe_id`).
    """
    from hyfi_imaging.paths import safe_id, under

    return under(Path(store) / "labels", safe_id(name, where=store, what="label image"))


def write_label_image(
    store: str | os.PathLike[str],
    labels: RegionSource,
    *,
    mpp: float | None,
    classes: Mapping[str, int],
    attrs: dict[str, Any],
    name: str = "annotations",
    chunk: int = 512,
    shard: int = 4096,
    pyramid_levels: int = 3,
    spacing: tuple[float, float] | None = None,
    origin: tuple[float, float] | None = None,
) -> Path:
    """Write a ``(1, H, W)`` uint8 label image as ``labels/<name>`` of the image group ``store``
    (``spacing``, ``origin``: a level-0 pixel's size and where pixel ``(0, 0)``'s centre
    lies, as its image's).

    ``labels`` is produced one shard at a time (memory stays a few shards);
    the levels, chunks and shards are those :func:`write_ome_zarr` gives an
    image of the same size. ``classes`` (class name -> value) fills
    ``image-label.properties``; ``attrs`` is stored as ``attributes.hyfi``
    (the annotation file and its fingerprint), beside the label image's chunk
    inventory (:mod:`hyfi_imaging.io.inventory`).
    """
    import zarr

    root = zarr.open_group(zarr.storage.LocalStore(Path(store)), mode="r+")
    group = root.require_group("labels").create_group(name)
    _, n_levels = write_pyramid(
        group,
        labels,
        dtype=np.dtype(np.uint8),
        chunk=chunk,
        shard=shard,
        pyramid_levels=pyramid_levels,
        fill_value=0,
        downsample=downsample_labels_2x,
    )
    values = sorted({0, *classes.values()})
    names: dict[int, list[str]] = {v: [] for v in values}
    for cls, v in classes.items():  # in the mapping's order: the first name names the class
        names[v].append(cls)
    group.attrs.update(
        {
            "ome": {
                "version": NGFF_VERSION,
                "multiscales": [
                    multiscales_metadata(
                        name,
                        mpp,
                        n_levels,
                        np.dtype(np.uint8),
                        method="mode",
                        description="2x2 mode per level (ties to the larger label)",
                        spacing=spacing,
                        origin=origin,
                    )
                ],
                "image-label": {
                    "colors": [{"label-value": v, "rgba": _color(v)} for v in values],
                    "properties": [
                        {
                            "label-value": v,
                            "class": names[v][0] if v and names[v] else "background",
                            "names": names[v],
                        }
                        for v in values
                    ],
                    "source": {"image": "../../"},
                },
            },
            "hyfi": attrs,
            # The label image's own shards: its reader guards them like the image's.
            INVENTORY_ATTR: take_inventory(
                label_path(store, name), [str(level) for level in range(n_levels)]
            ),
        }
    )
    root["labels"].attrs.update({"ome": {"version": NGFF_VERSION, "labels": [name]}})
    return label_path(store, name)


def label_names(store: str | os.PathLike[str]) -> list[str]:
    """The label images a store lists under ``labels`` (empty when it has none)."""
    from hyfi_imaging.io.zarr_store import _open_group_attrs

    attrs = _open_group_attrs(Path(store) / "labels") or {}
    listed = attrs.get("ome", attrs).get("labels", [])
    return [str(n) for n in listed] if isinstance(listed, list) else []


def open_labels(store: str | os.PathLike[str], name: str = "annotations") -> ZarrReader:
    """A :class:`ZarrReader` of label image ``name`` (one channel, uint8, background 0).

    Raises:
        SlideError: the store has no such label image.
    """
    from hyfi_imaging.errors import SlideError

    if name not in label_names(store):
        raise SlideError(
            store,
            f"the store has no label image {name!r} (it lists {label_names(store) or 'none'})",
            "preprocess the slides with --annotations DIR",
        )
    return ZarrReader(label_path(store, name))

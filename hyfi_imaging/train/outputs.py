"""What segmentation and regression write: mask label images, overlay pictures, a CSV.

Why here and not in the loop: ``hyfi-train`` (after its last evaluation) and
``hyfi-predict`` write the same files, from any layout.

* **Masks.** On a spatial grid each rank holds its tile of the predicted
  class map; the tiles are gathered over the ``sp`` group to the tile
  ``(0, 0)`` rank, cut free of the padded tail and written by rank 0 as
  ``<out>/masks/<id>.zarr``: an OME-Zarr (NGFF 0.5) group whose image is the
  class map (one uint8 channel) and whose ``labels/prediction`` is the same
  map as an NGFF label image (colours and class names, like the annotation
  masks of :mod:`hyfi_imaging.io.labels`), so viewers that know NGFF show it
  coloured. ``attributes.hyfi.image`` names the image it was predicted from (its absolute path).
  Volumes get the same layout with axes ``c, z, y, x``.
* **Overlays.** ``<out>/overlays/<id>.png``: the slide at its coarsest level
  of at most 1024 px (a volume: its middle z-plane) with the predicted mask in
  the label colours over it and, where the truth is known, the ground truth's
  outline (1 px, :data:`OUTLINE_RGB`, opaque) -- the picture to look at first:
  a miss is an outline with no colour inside, a false positive colour with no
  outline around it.
* **Scores.** ``val_per_image.csv`` / ``per_image.csv``: one row per image,
  the columns of :data:`~hyfi_imaging.train.seg_scores.SCORE_COLUMNS` (Dice, IoU,
  lesions, hits, false positives and a ``note`` stating the empty-truth rule).
* **Regressions.** One CSV row per image: id, then ``pred_<target>`` and,
  where known, ``true_<target>``.
"""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hyfi_imaging.parallel.collectives import all_gather_grid
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.paths import confined

__all__ = [
    "HEATMAP_KIND",
    "MASK_KIND",
    "check_replaceable",
    "OUTLINE_RGB",
    "gather_masks",
    "outline",
    "overlay_picture",
    "write_mask",
    "write_overlay",
    "write_regressions",
    "write_scores",
]

#: The colour of the ground truth's outline on the overlays: yellow, in no label colour.
OUTLINE_RGB: tuple[int, int, int] = (255, 255, 0)


def gather_masks(
    pred: Tensor, pc: ParallelContext, tile_hw: Sequence[int], size: Sequence[int]
) -> np.ndarray | None:
    """The whole ``(N, *size)`` uint8 class map on global rank 0 from every tile's ``pred``.

    ``pred`` is this rank's ``(N, *tile)`` tile of the arg-max classes (``tile_hw``: a
    tile, or a sub-volume on a 3-D grid). On a one-tile grid it is the map itself.
    Other ranks get None. Collective over the ``sp`` group (every spatial rank of the
    first replica must call it); the tiles are stitched by
    :func:`~hyfi_imaging.parallel.collectives.all_gather_grid`, the one place for that.
    """
    pred = pred.to(torch.uint8)
    if tuple(pred.shape[1:]) != tuple(int(t) for t in tile_hw):
        raise ValueError(f"a mask tile of {tuple(pred.shape[1:])} is not a tile of {tile_hw}")
    grid = pc.grid
    if math.prod(grid) == 1:
        return pred.cpu().numpy() if pc.rank == 0 else None
    # On the group's device (NCCL gathers device tensors, Gloo CPU ones).
    whole = all_gather_grid(pred.to(pc.device), grid, pc.group("sp"))
    if pc.rank != 0:
        return None
    return whole[(slice(None), *(slice(0, int(n)) for n in size))].cpu().numpy()


#: The ``hyfi.kind`` of each store a prediction writes (one per image), which it may replace.
MASK_KIND = "prediction"
HEATMAP_KIND = "class activation map"


def check_replaceable(out: Path, kind: str) -> None:
    """Refuse to replace ``out`` unless it is absent or a store of ``kind`` (an earlier
    prediction of the same image). ``--heatmaps`` given the data's own folder replaced every
    preprocessed slide by its heat map, exit 0: a prediction never removes other data."""
    if not out.exists() and not out.is_symlink():
        return
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.io.zarr_store import read_hyfi_attrs

    found = (read_hyfi_attrs(out) or {}).get("kind") if out.is_dir() else _png_kind(out)
    if found == kind:
        return
    what = f"a {found} store" if found else "a file" if out.is_file() else "other data"
    raise ConfigError(
        str(out),
        f"exists and is {what} (not a {kind} an earlier prediction wrote): it would be replaced",
        "write the predictions to another folder, never the data's own",
    )


def _png_kind(path: Path) -> str | None:
    """The ``hyfi-kind`` a PNG's text records (a heat map's picture), else None (a slide
    saved as PNG, any other file: ``--heatmaps`` given the slides' folder replaced them)."""
    from PIL import Image, UnidentifiedImageError

    from hyfi_imaging.train.plots import PNG_KIND_KEY

    try:
        with Image.open(path) as image:
            text = getattr(image, "text", {}) if image.format == "PNG" else {}
            return str(text[PNG_KIND_KEY]) if PNG_KIND_KEY in text else None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError):
        return None


def write_mask(
    out: Path,
    mask: np.ndarray,
    *,
    classes: Sequence[str],
    image: str,
    scale: float | Sequence[float] | None,
    level: int = 0,
) -> Path:
    """Write one ``(H, W)`` or ``(D, H, W)`` class map as ``out`` (see the module docstring).

    An existing ``out`` is replaced (a new prediction of the same image).
    ``scale``: microns per pixel of the map, or ``(z, y, x)`` per voxel, when known (the
    image's at the ``level`` the map is of, recorded with ``image``). An ``out``
    that climbs out of its folder (``masks/../../x.zarr``, from an id that was
    never checked) is refused before anything is touched
    (:func:`~hyfi_imaging.paths.confined`).
    """
    from hyfi_imaging.io.labels import write_label_image
    from hyfi_imaging.io.zarr_store import _ArraySource, write_ome_zarr

    confined(out)  # before anything is removed or written: an id must not climb out
    # the image's absolute path: one relative to where the command ran named nothing from
    # any other folder (a viewer opening the mask, a script beside the masks)
    attrs = {"kind": MASK_KIND, "image": os.path.abspath(image), "level": level,
             "classes": list(classes), "background": 0}  # fmt: skip
    check_replaceable(out, MASK_KIND)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if mask.ndim == 3:
        from hyfi_imaging.io.volume_store import write_ome_zarr_volume

        f = 2**level  # a map of level l: its voxel is the centre of 2**l image voxels
        # (unknown size: level-0 voxels as the unit, as the volume's own store has them)
        voxel = tuple(scale) if isinstance(scale, Sequence) else (scale or float(f),) * 3
        return write_ome_zarr_volume(
            out,
            mask[None].astype(np.uint8),
            voxel_size=voxel,
            origin=tuple(v / f * (f - 1) / 2 for v in voxel),
            chunks=32,
            channel_names=["class"],
            name=out.stem,
            attrs=attrs,
            labels={"prediction": mask.astype(np.uint8)},
            method="nearest",  # class numbers: a mean of classes 0 and 2 made class 1
        )
    mpp = scale[-1] if isinstance(scale, Sequence) else scale
    f = 2**level  # a map of level l: its pixel is the centre of 2**l image pixels
    # Without µm/px the axes count the image's level-0 pixels: a level-l map's pixel is
    # 2**l of them (it was drawn over the image's top-left quarter at half size).
    pixel = mpp if mpp is not None else float(f)
    origin = None if level == 0 else (pixel / f * (f - 1) / 2,) * 2
    spacing = None if mpp is not None else (pixel, pixel)
    write_ome_zarr(
        out,
        mask[None].astype(np.uint8),
        mpp=mpp,
        hyfi_attrs=attrs,
        name=out.stem,
        channel_names=["class"],
        spacing=spacing,
        origin=origin,
    )
    write_label_image(
        out,
        _ArraySource(mask[None].astype(np.uint8)),
        mpp=mpp,
        classes={name: value for value, name in enumerate(classes) if value},
        attrs=attrs,
        name="prediction",
        spacing=spacing,
        origin=origin,
    )
    return out


def _colour(mask: np.ndarray) -> np.ndarray:
    """``(h, w, 4)`` uint8 RGBA of a class map in the label colours (0 transparent)."""
    from hyfi_imaging.io.labels import LABEL_COLORS

    palette = np.array(LABEL_COLORS, dtype=np.uint8)
    index = np.where(mask == 0, 0, 1 + (mask.astype(np.int64) - 1) % (len(palette) - 1))
    return palette[index]


def _background(
    image_store: str, shape: Sequence[int], limit: int, level: int = 0
) -> tuple[np.ndarray, int]:
    """The image (RGB float in [0, 1], as :func:`~hyfi_imaging.preprocess.qc.picture` shows it)
    behind a map of pyramid level ``level``: that level's, or a coarser one of at most
    ``limit`` px, and how many of the map's pixels one of its pixels covers per side. (The
    level-1 map of a ``data.level: 1`` run was drawn over level 0's top-left quarter.)"""
    if len(shape) == 3:  # a volume: its middle z-plane, first channel, of the map's level
        from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume

        store = VolumeStore(image_store)
        d, h, w = store.shapes[level]
        plane = read_subvolume(store, level, (d // 2, 0, 0, 1, h, w))[0, 0].astype(np.float64)
        lo, hi = np.percentile(plane, [1, 99])
        grey = np.clip((plane - lo) / max(hi - lo, 1e-12), 0, 1)
        return np.repeat(grey[..., None], 3, axis=2), 1
    from hyfi_imaging.io.zarr_store import ZarrReader
    from hyfi_imaging.preprocess.qc import picture

    with ZarrReader(image_store) as reader:
        shown = level
        while shown + 1 < reader.level_count and max(reader.level_dimensions[shown]) > limit:
            shown += 1
        h, w = reader.level_dimensions[shown]
        # As the QC pictures show it: 16-bit or float channels over their display windows
        # (divided by 255 they were white), 8-bit RGB as it is
        rgb = picture(reader, reader.read_region(shown, 0, 0, h, w)).astype(np.float64) / 255.0
    return rgb, 2 ** (shown - level)


def outline(labels: np.ndarray) -> np.ndarray:
    """The 1-px inner outline of every labelled region of a 2-D class map (bool).

    A pixel is on it when its label is not 0 and one of its 4 neighbours has
    another label or lies past the image edge (so a region cut by the edge is
    closed there too).
    """
    padded = np.pad(labels, 1, constant_values=0)
    inner = padded[1:-1, 1:-1]
    differs = np.zeros(labels.shape, dtype=bool)
    for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        differs |= (
            padded[1 + dy : padded.shape[0] - 1 + dy, 1 + dx : padded.shape[1] - 1 + dx] != inner
        )
    return (labels != 0) & differs


def overlay_picture(
    rgb: np.ndarray, mask: np.ndarray, truth: np.ndarray | None = None
) -> np.ndarray:
    """``(h, w, 3)`` float RGB in [0, 1]: ``rgb`` with the class map blended over it and
    the ground truth's :func:`outline` drawn opaque in :data:`OUTLINE_RGB` (all three 2-D
    and of one size at the picture's scale)."""
    rgba = _colour(mask).astype(np.float64) / 255.0
    alpha = rgba[..., 3:4]
    blend = rgb * (1 - alpha) + rgba[..., :3] * alpha
    if truth is not None:
        blend[outline(truth)] = np.array(OUTLINE_RGB, dtype=np.float64) / 255.0
    return blend


def write_overlay(
    out: Path,
    mask: np.ndarray,
    *,
    image: str,
    title: str,
    truth: np.ndarray | None = None,
    limit: int = 1024,
    level: int = 0,
) -> Path:
    """A PNG of the image with the predicted class map over it (see the module docstring).

    ``truth``: the ground-truth class map of the same size as ``mask``, drawn as an
    outline. ``level``: the image's pyramid level the map is of (``data.level``).
    Refused like :func:`write_mask` when ``out`` climbs out of its folder.
    """
    confined(out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if truth is not None and truth.shape != mask.shape:
        raise ValueError(f"write_overlay: truth {truth.shape} and mask {mask.shape} differ")
    rgb, factor = _background(image, mask.shape, limit, level)

    def small(m: np.ndarray) -> np.ndarray:
        plane = m[m.shape[0] // 2] if m.ndim == 3 else m
        return plane[::factor, ::factor][: rgb.shape[0], : rgb.shape[1]]

    pred = small(mask)
    blend = overlay_picture(
        rgb[: pred.shape[0], : pred.shape[1]], pred, None if truth is None else small(truth)
    )
    if truth is not None:
        title += "\ncolour: prediction, yellow outline: ground truth"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 6 * blend.shape[0] / max(blend.shape[1], 1)))
    ax.imshow(blend, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.axis("off")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def write_regressions(
    out: Path,
    ids: Sequence[str],
    pred: np.ndarray,
    names: Sequence[str],
    truth: np.ndarray | None,
    splits: Sequence[str] | None = None,
    left_out: Sequence[tuple[int, str, str]] | None = None,
) -> Path:
    """One CSV row per image: ``id, [split | status,] pred_<name>... [, true_<name>...]``
    (atomically); ``splits`` (``train``/``val`` per row) is what a training run used each
    image for. ``left_out``: ``(position, id, status)`` of the manifest's rows that were not
    predicted (hyfi-predict: a ``status`` column), written at their place with their status
    and empty cells, as a classifier's CSV keeps them (the file accounts for every row); the
    others are ``ok``."""
    from hyfi_imaging.atomic import write_atomic

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    kind = ["split"] if splits is not None else ["status"] if left_out is not None else []
    header = ["id", *kind, *(f"pred_{n}" for n in names)]
    if truth is not None:
        header += [f"true_{n}" for n in names]
    w.writerow(header)
    rows: list[list[str]] = []
    for i, vid in enumerate(ids):
        row = [vid]
        if kind:
            row.append(splits[i] if splits is not None else "ok")
        # Every digit a float holds (repr round-trips): "%.6g" cut a manifest's target
        # 0.123456789 to 0.123457, and the prediction beside it.
        row += [repr(float(v)) for v in pred[i]]
        if truth is not None:
            row += [repr(float(v)) for v in truth[i]]
        rows.append(row)
    width = len(header) - 2
    for at, vid, status in sorted(left_out or ()):
        rows.insert(at, [vid, status, *[""] * width])
    w.writerows(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, buf.getvalue())


def write_scores(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Per-image segmentation scores as CSV, atomically: the columns of
    :data:`~hyfi_imaging.train.seg_scores.SCORE_COLUMNS` (rows of
    :meth:`~hyfi_imaging.train.seg_scores.ImageScore.row`); an undefined value is empty."""
    from hyfi_imaging.atomic import write_atomic
    from hyfi_imaging.train.seg_scores import SCORE_COLUMNS

    def cell(value: object) -> str:
        if value is None:
            return ""
        return f"{value:.6f}" if isinstance(value, float) else str(value)

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SCORE_COLUMNS)
    for r in rows:
        w.writerow([cell(r[c]) for c in SCORE_COLUMNS])
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, buf.getvalue())

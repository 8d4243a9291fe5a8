"""Where a class activation map lies on its slide, and the files that say so.

Why a module of its own: :mod:`.heatmaps` computes the maps on the tiles; what
is written is plain arithmetic on a store's provenance plus two writers, usable
on any ``(K, h, w)`` map.

Where a map pixel is: map pixel ``(i, j)`` stands for the ``s x s`` image
pixels ``[i s, (i+1) s) x [j s, (j+1) s)`` (``s``: the stride of the pooled
map times the pyramid level the model read), i.e. the map is stretched over
the image as CAM is usually shown. :func:`slide_frame` carries that through the
store's provenance (``source_box``, ``placement``: canvas ``(py + u, px + v)``
is source ``(sy + u sh/ph, sx + v sw/pw)``) onto the source slide's level-0
pixels, in micrometres where the slide's µm/px is known, as the OME-Zarr
``scale`` and ``translation`` (NGFF: pixel centres), so a viewer that opens
the slide with its resolution lays the map on it. The transform onto the
store's own canvas is recorded beside it (``attributes.hyfi.canvas_transform``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hyfi_imaging.train.outputs import HEATMAP_KIND, check_replaceable

__all__ = ["SlideFrame", "slide_frame", "write_heatmap", "write_heatmap_png"]


@dataclass(frozen=True)
class SlideFrame:
    """An NGFF ``scale`` and ``translation`` per axis ``(y, x)`` and their unit.

    ``unit`` is ``"micrometer"``, or None for pixels of the frame (slide level-0
    pixels when the slide's µm/px is unknown). ``frame`` says which image the
    numbers place the map on: ``"slide"`` (the source, through the store's
    provenance) or ``"store"`` (a store without provenance: its own canvas).
    """

    scale: tuple[float, float]
    translation: tuple[float, float]
    unit: str | None
    frame: Literal["slide", "store"]


def _centres(
    step: Sequence[float], first: Sequence[float], mpp: float | None
) -> tuple[tuple[float, float], tuple[float, float]]:
    """NGFF scale and translation of a map whose pixel ``i`` covers the frame's continuous
    ``[first + i step, first + (i+1) step)`` (per axis), times ``mpp`` when given."""
    unit = 1.0 if mpp is None else mpp
    # Map pixel i's centre is the frame's continuous first + (i + 1/2) step, i.e. frame pixel
    # index first + (i + 1/2) step - 1/2 (NGFF: frame pixel k is centred on k).
    scale = tuple(s * unit for s in step)
    trans = tuple((f + s / 2 - 0.5) * unit for f, s in zip(first, step, strict=True))
    return (scale[0], scale[1]), (trans[0], trans[1])


def slide_frame(attrs: Mapping[str, Any], canvas_stride: Sequence[float]) -> SlideFrame:
    """Where a map of ``canvas_stride`` store level-0 pixels per map pixel lies on the slide.

    ``attrs``: the store's ``hyfi`` attributes. With ``source_box``
    ``(sy, sx, sh, sw)`` and ``placement`` ``(py, px, ph, pw)``, canvas
    ``u`` is source ``sy + (u - py) sh / ph``: the map's pixel ``i`` covers source
    ``[sy + (i S - py) r, sy + ((i+1) S - py) r)`` with ``r = sh / ph``, in
    micrometres when ``source_mpp`` is known. Without provenance, the store's
    own frame (``mpp``).
    """
    s = [float(v) for v in canvas_stride]
    box, place = attrs.get("source_box"), attrs.get("placement")
    if box is not None and place is not None:
        sy, sx, sh, sw = (float(v) for v in box)
        py, px, ph, pw = (float(v) for v in place)
        r = (sh / ph, sw / pw)
        step = (s[0] * r[0], s[1] * r[1])
        first = (sy - py * r[0], sx - px * r[1])
        mpp = attrs.get("source_mpp")
        scale, trans = _centres(step, first, float(mpp) if mpp else None)
        return SlideFrame(scale, trans, "micrometer" if mpp else None, "slide")
    mpp = attrs.get("mpp")
    scale, trans = _centres(s, (0.0, 0.0), float(mpp) if mpp else None)
    return SlideFrame(scale, trans, "micrometer" if mpp else None, "store")


def _level_downsample(store: str, level: int) -> tuple[float, float]:
    from hyfi_imaging.io.zarr_store import ZarrReader

    with ZarrReader(store) as reader:
        return reader.level_downsamples[level]


def write_heatmap(
    out: Path,
    cam: np.ndarray,
    *,
    image: str,
    level: int,
    stride: tuple[int, int],
    pool: str,
    classes: Sequence[str],
    logits: Sequence[float] | None = None,
) -> Path:
    """Write one ``(K, fh, fw)`` map of ``image`` as the OME-Zarr ``out`` (replaced if there).

    One float32 channel per class, one pyramid level; the NGFF transform is
    :func:`slide_frame`'s, ``attributes.hyfi`` records the stride, the canvas
    transform, the pool and the logits. Written under a temporary name and
    renamed, so a killed run leaves no half map.
    """
    from hyfi_imaging.io.zarr_store import read_hyfi_attrs, write_ome_zarr
    from hyfi_imaging.paths import confined

    confined(out)
    attrs = read_hyfi_attrs(image) or {}
    dy, dx = _level_downsample(image, level)
    canvas_stride = (stride[0] * dy, stride[1] * dx)
    frame = slide_frame(attrs, canvas_stride)
    canvas = slide_frame({"mpp": attrs.get("mpp")}, canvas_stride)
    hyfi = {
        "kind": HEATMAP_KIND,
        "image": os.path.abspath(image),  # as a mask's: from any folder
        "slide_id": attrs.get("slide_id"),
        "source": attrs.get("source"),
        "frame": frame.frame,
        "classes": list(classes),
        "pool": pool,
        "mean_is_logit": pool == "avg",
        "level": level,
        "stride": list(canvas_stride),
        "canvas_transform": {
            "scale": list(canvas.scale),
            "translation": list(canvas.translation),
            "unit": canvas.unit,
        },
        "logits": None if logits is None else [float(v) for v in logits],
        "background": 0.0,
    }
    check_replaceable(out, HEATMAP_KIND)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_ome_zarr(
            tmp,
            np.ascontiguousarray(cam, dtype=np.float32),
            mpp=1.0 if frame.unit else None,  # the unit; the numbers are the frame's
            hyfi_attrs=hyfi,
            pyramid_levels=1,
            name=out.name.removesuffix(".zarr"),
            channel_names=list(classes),
            spacing=frame.scale,
            origin=frame.translation,
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def write_heatmap_png(
    out: Path,
    cam: np.ndarray,
    *,
    image: str,
    level: int,
    stride: tuple[int, int],
    classes: Sequence[str],
    title: str,
    probs: Sequence[float] | None = None,
    limit: int = 1024,
) -> Path:
    """A PNG of the store's thumbnail (its coarsest level of at most ``limit`` px) with each
    class's map over it, one panel per class, colour bar in logit units."""
    from hyfi_imaging.paths import confined
    from hyfi_imaging.train.outputs import HEATMAP_KIND, _background
    from hyfi_imaging.train.plots import _new_figure, _save_atomic

    confined(out)
    dy, dx = _level_downsample(image, level)
    k, fh, fw = cam.shape
    rgb, factor = _background(image, (fh, fw), limit)
    th, tw = rgb.shape[:2]
    # Canvas c is thumbnail pixel coordinate c / factor - 1/2 in imshow's frame.
    right = fw * stride[1] * dx / factor - 0.5
    bottom = fh * stride[0] * dy / factor - 0.5
    fig = _new_figure(4.6 * k, 4.6 * th / max(tw, 1) + 0.8)
    axes = fig.subplots(1, k, squeeze=False)[0]
    for c, ax in enumerate(axes):
        ax.imshow(rgb, interpolation="nearest")
        im = ax.imshow(
            cam[c],
            cmap="inferno",
            alpha=0.55,
            extent=(-0.5, right, bottom, -0.5),
            interpolation="nearest",
        )
        ax.set_xlim(-0.5, tw - 0.5)
        ax.set_ylim(th - 0.5, -0.5)
        ax.axis("off")
        p = f" (p {probs[c]:.3f})" if probs is not None else ""
        ax.set_title(f"{classes[c]}{p}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="class activation (logit)")
    fig.suptitle(title, fontsize=10)
    return _save_atomic(fig, out, HEATMAP_KIND)

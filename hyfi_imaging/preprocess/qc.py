"""Quality-control pictures: one per slide, and a contact sheet of the cohort.

A researcher checks a preprocessing run by eye long before any metric: was
the tissue found, is the crop box sensible, did the canvas come out right?
Each slide gets ``qc/<slide_id>.png``: the source thumbnail with the tissue
outline (green) and crop box (red), beside the output canvas. The contact
sheet puts all of them, failures included (with their reason), on one page.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage
from skimage import morphology

from hyfi_imaging.io.base import SlideReader, thumbnail

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.canvas import CropPlan
    from hyfi_imaging.preprocess.convert import ConvertResult

__all__ = ["write_contact_sheet", "write_slide_qc"]

_QC_SIZE = 512


def _to_pil(chw: np.ndarray) -> Image.Image:
    arr = np.moveaxis(chw[:3] if chw.shape[0] >= 3 else np.repeat(chw[:1], 3, 0), 0, -1)
    return Image.fromarray(np.ascontiguousarray(arr))


def write_slide_qc(
    path: Path,
    reader: SlideReader,
    mask: np.ndarray,
    mask_ds: float,
    plan: CropPlan,
    canvas: SlideReader,
) -> Path:
    """Write the QC picture of one slide and return its path.

    ``canvas`` reads the written output (its OME-Zarr store): the canvas is
    never held in memory, and the picture shows what training will read.
    """
    thumb, ds = thumbnail(reader, _QC_SIZE)
    left = _to_pil(thumb)
    # Tissue outline: mask boundary, resized to this thumbnail.
    mask_img = Image.fromarray(mask.astype(np.uint8) * 255).resize(
        left.size, Image.Resampling.NEAREST
    )
    m = np.asarray(mask_img) > 0
    edge = m & ~ndimage.binary_erosion(m, structure=morphology.disk(1))
    edge = ndimage.binary_dilation(edge, iterations=1)  # visible at contact-sheet scale
    arr = np.asarray(left).copy()
    arr[edge] = (0, 200, 0)
    left = Image.fromarray(arr)
    draw = ImageDraw.Draw(left)
    sy, sx, sh, sw = plan.source_box
    draw.rectangle(
        [sx / ds, sy / ds, (sx + sw) / ds - 1, (sy + sh) / ds - 1], outline=(220, 0, 0), width=2
    )
    right = _to_pil(thumbnail(canvas, _QC_SIZE)[0])
    height = max(left.height, right.height)
    sheet = Image.new("RGB", (left.width + right.width + 8, height), (255, 255, 255))
    sheet.paste(left, (0, 0))
    sheet.paste(right, (left.width + 8, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    sheet.save(tmp)
    tmp.replace(path)
    return path


def write_contact_sheet(
    results: Sequence[ConvertResult], labels: dict[str, str], path: Path, *, columns: int = 4
) -> Path:
    """All slides' QC pictures on one page, titled with slide id, label and status."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(results))
    cols = min(columns, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, res in zip(axes.flat, results, strict=False):
        label = labels.get(res.slide_id, "")
        title = f"{res.slide_id}" + (f"  label={label}" if label else "")
        if res.status != "failed" and res.qc and Path(res.qc).exists():
            ax.imshow(np.asarray(Image.open(res.qc)))
            ax.set_title(title, fontsize=9)
        else:
            ax.set_title(title + "  FAILED", fontsize=9, color="red")
            ax.text(
                0.5,
                0.5,
                textwrap.fill(res.error or "failed", 48),
                ha="center",
                va="center",
                fontsize=7,
                color="red",
                transform=ax.transAxes,
            )
    fig.suptitle("hyfi-preprocess QC: tissue outline (green), crop box (red) | output canvas")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(path)
    return path

"""Quality-control pictures: one per slide, and a contact sheet of the cohort.

A researcher checks a preprocessing run by eye long before any metric: was
the tissue found, is the crop box sensible, did the canvas come out right?
Each slide gets ``qc/<slide_id>.png``: the source thumbnail with the tissue
outline (green) and crop box (red), beside the output canvas. The contact
sheet puts all of them, failures included (with their reason), on one page.

Images that are not 8-bit RGB (16-bit, fluorescence, multiplex) are shown as a
colour composite: each chosen channel is scaled to ``[0, 1]`` over its display
window (the store's ``omero`` window: the 0.5-99.5th percentiles of the
tissue) and added in its colour. By default the first three channels (their
own colours: red, green, blue unless the file says otherwise) or, for one
channel, grey; ``hyfi-preprocess --qc-channels DAPI:blue,CD8:green,3:red``
chooses others (:class:`QcChannels`); colours given there also go into the
store's ``omero`` metadata, so a viewer shows what the QC picture shows. 8-bit
RGB is shown as it is.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage
from skimage import morphology

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.io.base import Downsample, SlideReader, thumbnail
from hyfi_imaging.io.pixels import dtype_range, is_rgb

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.canvas import CropPlan
    from hyfi_imaging.preprocess.convert import ConvertResult

__all__ = [
    "COLOR_NAMES",
    "QcChannels",
    "Shown",
    "picture",
    "composite",
    "write_contact_sheet",
    "write_slide_qc",
]

_QC_SIZE = 512

#: Colour names ``--qc-channels`` accepts besides ``RRGGBB``.
COLOR_NAMES = {
    "red": "FF0000",
    "green": "00FF00",
    "blue": "0000FF",
    "cyan": "00FFFF",
    "magenta": "FF00FF",
    "yellow": "FFFF00",
    "orange": "FF8000",
    "white": "FFFFFF",
    "gray": "FFFFFF",
    "grey": "FFFFFF",
}

#: A channel shown: its index and its colour as ``(r, g, b)`` in ``[0, 1]``.
Shown = tuple[int, tuple[float, float, float]]


def _hex_of(color: str, where: str) -> str:
    """A colour name or ``[#]RRGGBB`` as ``RRGGBB`` (the form omero metadata stores)."""
    hexa = COLOR_NAMES.get(color.lower(), color).lstrip("#")
    try:
        if len(hexa) != 6:
            raise ValueError(hexa)
        int(hexa, 16)
    except ValueError:
        raise ConfigError(
            where,
            f"colour {color!r} is neither RRGGBB nor a colour name",
            f"use one of {', '.join(COLOR_NAMES)} or e.g. 00FF00",
        ) from None
    return hexa.upper()


def _rgb_of(color: str, where: str) -> tuple[float, float, float]:
    value = int(_hex_of(color, where), 16)
    return ((value >> 16) / 255, ((value >> 8) & 255) / 255, (value & 255) / 255)


@dataclass(frozen=True)
class QcChannels:
    """Which channels the QC pictures show, in which colours.

    ``spec`` holds ``CHANNEL[:COLOUR]`` items: a channel index or name, a
    colour name (:data:`COLOR_NAMES`) or ``RRGGBB`` (default: the channel's
    own colour). Empty: the default (RGB as it is; the first three channels;
    one channel grey).

    OK: ``QcChannels.parse("DAPI:blue,CD8:green,5")``.
    Error: ``QcChannels.parse("DAPI:bleu")`` raises ConfigError naming the colours.
    """

    spec: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> QcChannels:
        """Read ``--qc-channels`` (comma-separated); colours are checked here."""
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        if not items:
            raise ConfigError(
                "--qc-channels", "names no channel", "give e.g. DAPI:blue,CD8:green or 0,1,2"
            )
        for item in items:
            if ":" in item:
                _rgb_of(item.rsplit(":", 1)[1], f"--qc-channels {item}")
        return cls(items)

    def resolve(self, reader: SlideReader) -> list[Shown] | None:
        """The channels and colours to show for ``reader``; ``None``: 8-bit RGB shown as it is.

        Raises SlideError naming the reader's channels when an item names none of them.
        """
        names, colors = reader.channel_names, reader.channel_colors
        if not self.spec:
            if is_rgb(names) and reader.dtype == np.uint8:
                return None
            if reader.channels == 1:
                return [(0, (1.0, 1.0, 1.0))]
            return [(i, _rgb_of(colors[i], reader.path)) for i in range(min(3, reader.channels))]
        return [
            (index, _rgb_of(color or colors[index], f"--qc-channels {item}"))
            for item, index, color in self._items(reader)
        ]

    def colors(self, reader: SlideReader) -> tuple[str, ...]:
        """The ``RRGGBB`` colour of every channel of ``reader`` for the store's omero metadata.

        The file's own colours, except where an item gives one (``DAPI:blue``):
        what the QC picture shows is what a viewer of the store shows.
        """
        colors = list(reader.channel_colors)
        for item, index, color in self._items(reader):
            if color:
                colors[index] = _hex_of(color, f"--qc-channels {item}")
        return tuple(colors)

    def _items(self, reader: SlideReader) -> list[tuple[str, int, str]]:
        """``(item, channel index, colour or "")`` of every item, checked against ``reader``."""
        names = reader.channel_names
        found = []
        for item in self.spec:
            channel, _, color = item.partition(":")
            if channel in names:
                index = names.index(channel)
            elif channel.isdigit() and int(channel) < reader.channels:
                index = int(channel)
            else:
                raise SlideError(
                    reader.path,
                    f"--qc-channels names channel {channel!r}, which this image does not have "
                    f"(channels: {', '.join(names)})",
                    "name channels by index or by one of those names",
                )
            found.append((item, index, color))
        return found


def composite(
    chw: np.ndarray, shown: list[Shown] | None, windows: Sequence[tuple[float, float]]
) -> np.ndarray:
    """An 8-bit ``(h, w, 3)`` picture of ``chw``: each shown channel over its window, in its colour.

    ``shown=None`` shows 8-bit RGB as it is. ``windows`` are ``(start, end)`` per channel.
    """
    if shown is None:
        arr = np.moveaxis(chw[:3] if chw.shape[0] >= 3 else np.repeat(chw[:1], 3, 0), 0, -1)
        return np.ascontiguousarray(arr)
    out = np.zeros((*chw.shape[1:], 3), dtype=np.float32)
    for index, rgb in shown:
        start, end = windows[index]
        v = np.clip((chw[index].astype(np.float32) - start) / max(end - start, 1e-12), 0, 1)
        for k in range(3):
            if rgb[k]:
                out[..., k] += v * np.float32(rgb[k])
    return np.rint(np.clip(out, 0, 1) * 255).astype(np.uint8)


def picture(reader: SlideReader, chw: np.ndarray) -> np.ndarray:
    """An 8-bit ``(h, w, 3)`` picture of ``chw`` read from ``reader`` as the QC pictures show
    it: 8-bit RGB as it is; other images' first channels (one: grey) in their colours, each
    over the store's display window (the type's range where it has none)."""
    windows = getattr(reader, "channel_windows", None) or (dtype_range(reader.dtype),) * (
        reader.channels
    )
    return composite(chw, QcChannels().resolve(reader), windows)


def _outline(mask: np.ndarray) -> np.ndarray:
    """The boundary of a boolean mask, thickened to show at contact-sheet scale."""
    edge = mask & ~ndimage.binary_erosion(mask, structure=morphology.disk(1))
    return np.asarray(ndimage.binary_dilation(edge, iterations=1))


def write_slide_qc(
    path: Path,
    reader: SlideReader,
    mask: np.ndarray,
    mask_ds: Downsample,
    plan: CropPlan,
    canvas: SlideReader,
    shown: list[Shown] | None = None,
    labels: SlideReader | None = None,
) -> Path:
    """Write the QC picture of one slide and return its path.

    ``canvas`` reads the written output (its OME-Zarr store): the canvas is
    never held in memory, and the picture shows what training will read.
    ``shown`` is :meth:`QcChannels.resolve`'s answer for ``reader``; both
    halves use the store's display windows (``omero``; the type's range when
    the store has none). ``labels`` (the store's label image, from
    ``--annotations``) adds the annotation outline in yellow to the canvas half.
    """
    windows = getattr(canvas, "channel_windows", None) or (dtype_range(canvas.dtype),) * (
        canvas.channels
    )
    thumb, (dy, dx) = thumbnail(reader, _QC_SIZE)
    left = Image.fromarray(composite(thumb, shown, windows))
    # Tissue outline: mask boundary, resized to this thumbnail.
    mask_img = Image.fromarray(mask.astype(np.uint8) * 255).resize(
        left.size, Image.Resampling.NEAREST
    )
    arr = np.asarray(left).copy()
    arr[_outline(np.asarray(mask_img) > 0)] = (0, 200, 0)
    left = Image.fromarray(arr)
    draw = ImageDraw.Draw(left)
    sy, sx, sh, sw = plan.source_box
    draw.rectangle(
        [sx / dx, sy / dy, (sx + sw) / dx - 1, (sy + sh) / dy - 1], outline=(220, 0, 0), width=2
    )
    right = Image.fromarray(composite(thumbnail(canvas, _QC_SIZE)[0], shown, windows))
    if labels is not None:
        annotated = thumbnail(labels, _QC_SIZE)[0][0] > 0
        if annotated.shape == (right.height, right.width) and annotated.any():
            arr = np.asarray(right).copy()
            arr[_outline(annotated)] = (255, 210, 0)
            right = Image.fromarray(arr)
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

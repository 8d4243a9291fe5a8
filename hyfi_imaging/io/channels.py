"""Per-channel metadata of a store: statistics, display windows, NGFF ``omero``.

Why stored at all: a 40-channel uint16 image has no obvious way to be shown or
normalised, and finding each channel's percentiles at load time would read
the image again for every epoch. So when a store is written, the coarsest
pyramid level (within the tissue placement) is summarised once:
percentiles, mean and standard deviation per channel, under
``attributes.hyfi_stats`` (:func:`channel_stats`); the NGFF ``omero`` block
gives every channel a label, a colour and a display window (the type's range
for RGB, else the 0.5-99.5th percentiles) for QC pictures and other viewers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyfi_imaging.io.pixels import default_channels, dtype_range, is_rgb

__all__ = [
    "STAT_PERCENTILES",
    "channel_stats",
    "omero_metadata",
    "parse_omero",
    "qpi_color",
    "stat_percentile",
]

#: Percentiles of every channel stored under ``attributes.hyfi_stats``.
STAT_PERCENTILES = (
    0.0,
    0.1,
    0.5,
    1.0,
    2.0,
    5.0,
    25.0,
    50.0,
    75.0,
    95.0,
    98.0,
    99.0,
    99.5,
    99.9,
    100.0,
)
#: Pixels per channel the statistics are taken from at most (an even subsample beyond).
_STAT_SAMPLES = 1 << 20
#: The display window of intensity channels, in percentiles.
_WINDOW_PERCENTILES = (0.5, 99.5)


def channel_stats(arr: Any, box: tuple[int, int, int, int] | None, level: int) -> dict[str, Any]:
    """Percentiles, mean and std of every channel of level ``level`` (``arr``) within ``box``.

    ``box`` is ``(y, x, h, w)`` in level-0 pixels (default: the whole level),
    taken to the level's pixels that touch it. More than ``_STAT_SAMPLES``
    pixels are subsampled on an even grid; the level is read in strips.
    """
    c, h, w = (int(v) for v in arr.shape)
    f = 2**level
    y0, x0, y1, x1 = 0, 0, h, w
    if box is not None:
        by, bx, bh, bw = box
        y0, x0 = max(0, by // f), max(0, bx // f)
        y1, x1 = min(h, -(-(by + bh) // f)), min(w, -(-(bx + bw) // f))
    y1, x1 = max(y1, y0 + 1), max(x1, x0 + 1)
    step = max(1, math.ceil(math.sqrt((y1 - y0) * (x1 - x0) / _STAT_SAMPLES)))
    row_bytes = c * (x1 - x0) * arr.dtype.itemsize
    rows = max(1, (64 << 20) // max(1, row_bytes) // step) * step
    parts = [
        np.asarray(arr[:, r : min(r + rows, y1), x0:x1])[:, ::step, ::step].reshape(c, -1)
        for r in range(y0, y1, rows)
    ]
    values = np.concatenate(parts, axis=1)
    table, mean, std = [], [], []
    for channel in values:
        v = channel.astype(np.float64)
        table.append([float(p) for p in np.percentile(v, STAT_PERCENTILES)])
        mean.append(float(v.mean()))
        std.append(float(v.std()))
    return {
        "level": level,
        "box": [y0, x0, y1 - y0, x1 - x0],
        "step": step,
        "percentiles": list(STAT_PERCENTILES),
        "values": table,
        "mean": mean,
        "std": std,
    }


def stat_percentile(stats: dict[str, Any], channel: int, q: float) -> float:
    """Percentile ``q`` of ``channel`` from ``attributes.hyfi_stats`` (``q`` must be in the table)."""
    return float(stats["values"][channel][list(stats["percentiles"]).index(q)])


def omero_metadata(
    names: Sequence[str], colors: Sequence[str], dtype: np.dtype[np.generic], stats: dict[str, Any]
) -> dict[str, Any]:
    """NGFF ``omero`` rendering metadata: label, colour and display window of every channel."""
    lo, hi = dtype_range(dtype)
    rgb = is_rgb(names)
    channels = []
    for i, (name, color) in enumerate(zip(names, colors, strict=True)):
        if dtype.kind == "f":
            lo, hi = stat_percentile(stats, i, 0.0), stat_percentile(stats, i, 100.0)
        if rgb:
            start, end = lo, hi
        else:
            start, end = (stat_percentile(stats, i, q) for q in _WINDOW_PERCENTILES)
        if end <= start:  # a flat channel: a window one step wide
            end = start + (1.0 if dtype.kind in "ui" else max(abs(start), 1.0) * 1e-3)
        channels.append(
            {
                "label": name,
                "color": color,
                "active": rgb or i < 3,
                "coefficient": 1.0,
                "family": "linear",
                "inverted": False,
                "window": {"min": lo, "max": max(hi, end), "start": start, "end": end},
            }
        )
    return {"rdefs": {"model": "color"}, "channels": channels}


def qpi_color(text: str | None) -> str | None:
    """A QPTIFF page's ``<Color>`` (``"R,G,B"``, 0-255 each) as ``RRGGBB``, or ``None``.

    Why here: the file's own colours (DAPI blue, FITC green, Cy3 yellow) are
    what the pathologist knows the channels by; a palette colour in their place
    shows nuclei red. ``None`` for anything else, so a damaged value falls back
    to the palette instead of failing the slide.
    """
    parts = (text or "").replace(";", ",").split(",")
    try:
        rgb = [int(p.strip()) for p in parts]
    except ValueError:
        return None
    if len(rgb) != 3 or not all(0 <= v <= 255 for v in rgb):
        return None
    return "{:02X}{:02X}{:02X}".format(*rgb)


def parse_omero(
    omero: Any, channels: int, dtype: np.dtype[np.generic]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[float, float], ...]]:
    """Names, colours and display windows ``(start, end)`` from NGFF ``omero`` metadata.

    Without usable metadata: the defaults (RGB for 3 uint8 channels) and the type's range.
    """
    names, colors = default_channels(channels, rgb=channels == 3 and dtype == np.uint8)
    windows = (dtype_range(dtype),) * channels
    entries = omero.get("channels") if isinstance(omero, dict) else None
    if not isinstance(entries, list) or len(entries) != channels:
        return names, colors, windows
    got_names, got_colors, got_windows = [], [], []
    for i, entry in enumerate(entries):
        entry = entry if isinstance(entry, dict) else {}
        got_names.append(str(entry.get("label") or names[i]))
        got_colors.append(str(entry.get("color") or colors[i]))
        window: Any = entry.get("window")
        try:
            got_windows.append((float(window["start"]), float(window["end"])))
        except (KeyError, TypeError, ValueError):
            got_windows.append(windows[i])
    return tuple(got_names), tuple(got_colors), tuple(got_windows)

"""A picture of how one image is cut into tiles and halos for a spatial grid.

Users reason about spatial parallelism in pictures: which rank owns which
tile, how far each halo reaches into the neighbours, where the global padding
starts. This draws exactly the regions the loader reads
(:func:`hyfi_imaging.data.tiles.tile_regions`), so the figure cannot drift
from the code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hyfi_imaging.data.tiles import TileRegion

__all__ = ["plot_tile_grid"]

_COLOURS = (
    "tab:red",
    "tab:blue",
    "tab:green",
    "tab:orange",
    "tab:purple",
    "tab:cyan",
    "tab:olive",
    "tab:brown",
)


def plot_tile_grid(
    image: np.ndarray, regions: Sequence[TileRegion], path: Path, *, title: str = ""
) -> Path:
    """Draw ``image`` (uint8 ``(C, H, W)``) with every rank's tile (solid) and read box (dashed).

    A second panel shows each rank's read region as that rank receives it
    (tile plus halo, background outside the image).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from hyfi_imaging.data.tiles import read_tile
    from hyfi_imaging.io.base import ArrayReader

    reader = ArrayReader(np.ascontiguousarray(image[:3]))
    rgb = np.moveaxis(image[:3], 0, -1)
    gy, gx = regions[0].grid
    fig = plt.figure(figsize=(12, 6))
    ax = fig.add_subplot(1, 2, 1)
    ax.imshow(rgb)
    hp, wp = regions[0].padded_hw
    ax.add_patch(Rectangle((-0.5, -0.5), wp, hp, fill=False, ec="grey", ls=":", lw=1))
    for n, reg in enumerate(regions):
        c = _COLOURS[n % len(_COLOURS)]
        y, x, h, w = reg.owned
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), w, h, fill=False, ec=c, lw=2))
        y, x, h, w = reg.read
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), w, h, fill=False, ec=c, lw=1.2, ls="--"))
        oy, ox, oh, ow = reg.owned
        ax.text(
            ox + ow / 2,
            oy + oh / 2,
            f"rank {reg.rank[0]},{reg.rank[1]}",
            color=c,
            ha="center",
            va="center",
            fontsize=10,
            weight="bold",
            bbox={"facecolor": "white", "alpha": 0.7, "lw": 0},
        )
    ax.set_xlim(-0.5 - max(r.halo[2] for r in regions), wp + max(r.halo[3] for r in regions))
    ax.set_ylim(hp + max(r.halo[1] for r in regions), -0.5 - max(r.halo[0] for r in regions))
    t, b, left, right = regions[0].halo
    ax.set_title(
        title
        or f"{gy}x{gx} tiles (solid), reads with halo (dashed) "
        f"top/bottom/left/right = {t}/{b}/{left}/{right} px",
        fontsize=9,
    )
    for n, reg in enumerate(regions):
        sub = fig.add_subplot(gy, 2 * gx, reg.rank[0] * 2 * gx + gx + reg.rank[1] + 1)
        _, _, h, w = reg.read
        sub.imshow(np.moveaxis(read_tile(reader, reg), 0, -1))
        t, b, left, right = reg.halo
        c = _COLOURS[n % len(_COLOURS)]
        sub.add_patch(
            Rectangle((left - 0.5, t - 0.5), reg.owned[3], reg.owned[2], fill=False, ec=c, lw=1.5)
        )
        sub.set_title(f"rank {reg.rank[0]},{reg.rank[1]} reads {h}x{w}", fontsize=8, color=c)
        sub.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
